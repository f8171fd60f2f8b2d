"""CheckpointReader over its own mapping of safetensors files: every dtype and shape reads
bitwise as safetensors reads it, tensors are views (no read, no copy), a write into one stays
private, an unaligned tensor is still read right, and a wrong index names the tensor."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.loading import CheckpointError, CheckpointReader
from freetoken.loading.validate import validate_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, 2, generator=g).bfloat16(),
        "f16": torch.randn(4, generator=g).half(),
        "u8": torch.randint(0, 255, (6, 3), generator=g, dtype=torch.uint8),
        "f8": torch.randn(2, 8, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(5),
        "i32": torch.arange(3, dtype=torch.int32),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "flag": torch.tensor([True, False]),
    }


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_reader_returns_every_dtype_bitwise_as_safetensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    reference = load_file(tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.names()) == sorted(tensors)
    for name, want in reference.items():
        got = reader.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert _raw(got) == _raw(want), name
        assert reader.meta(name)[0] == tuple(want.shape), name


def test_tensors_are_views_of_one_mapping_and_writes_stay_private(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(1024.0), "b": torch.ones(256)}, path)
    before = path.read_bytes()
    reader = CheckpointReader(tmp_path)
    a, b = reader.get("a"), reader.get("b")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), (
        "tensors of one file should share the file's mapping, not be copies")
    a.mul_(-1)
    assert path.read_bytes() == before, "a write into a loaded tensor reached the file"
    assert torch.equal(CheckpointReader(tmp_path).get("a"), torch.arange(1024.0))


def _write_raw(path, entries: dict[str, tuple[str, list[int], bytes]], pad: int) -> None:
    """A safetensors file whose data section starts `pad` bytes in (offsets unaligned)."""
    header, data, at = {}, b"\0" * pad, pad
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_an_unaligned_tensor_is_read_right(tmp_path):
    values = torch.arange(6, dtype=torch.float32) / 3
    _write_raw(tmp_path / "model.safetensors",
               {"x": ("F32", [2, 3], values.numpy().tobytes())}, pad=1)
    got = CheckpointReader(tmp_path).get("x")
    assert torch.equal(got, values.reshape(2, 3)), got


def test_an_index_naming_the_wrong_file_names_the_tensor(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "model-1.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "model-2.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-2.safetensors", "b": "model-2.safetensors"}}))
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="tensor 'a' in model-2.safetensors"):
        reader.get("a")


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64)}, path)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor 'a' ends at byte"):
        CheckpointReader(tmp_path)


def test_registration_ahead_covers_every_window_once_and_stops_at_a_refusal(monkeypatch):
    """The loader's background registration (GPU loads) pins each window holding a planned
    tensor once, while the main thread plans; a refusal stops it and turns the registered
    pages off for the copies."""
    from freetoken.loading import mapped
    from freetoken_verify.cases.catalogue import GOLDEN

    calls: list[tuple[int, int]] = []
    refuse_after = {"n": 10**9}

    def fake_register(address, nbytes, flags):
        calls.append((address, nbytes))
        return 0 if len(calls) <= refuse_after["n"] else 1

    monkeypatch.setattr(mapped, "_gil_free_register", lambda: fake_register)
    monkeypatch.setattr(mapped.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(mapped, "_clear_last_error", lambda: None)
    monkeypatch.setattr(mapped, "REGISTER_WINDOW", 4096)
    reader = CheckpointReader(GOLDEN / "tiny-qwen3.5-moe-nvfp4")
    names = reader.names()
    size = (GOLDEN / "tiny-qwen3.5-moe-nvfp4" / "model.safetensors").stat().st_size
    first = min(reader.extent(n)[0] for n in names) // 4096
    last = -(-max(reader.extent(n)[1] for n in names) // 4096)
    ahead = _register_planned(mapped, reader, names)
    base = ahead._file("model.safetensors").bytes.data_ptr()
    got = sorted(((a - base) // 4096, n) for a, n in calls)
    assert got == [(w, min(4096, size - w * 4096)) for w in range(first, last)], got[:5]
    assert ahead.usable

    calls.clear()
    refuse_after["n"] = 3
    refused = _register_planned(mapped, reader, names)
    assert len(calls) == 4 and not refused.usable, (len(calls), refused.usable)


def _register_planned(mapped, reader, names):
    """A MappedCheckpoint that registered the windows of `names` ahead, thread finished."""
    checkpoint = mapped.MappedCheckpoint(reader)
    checkpoint.register_ahead(torch.device("cpu"))
    for name in names:
        checkpoint.ahead(name)
    checkpoint.ahead_done()
    checkpoint._ahead.join()
    return checkpoint


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path):
    """An index listing one tensor twice (two files, different values; json keeps the last
    silently, so the last won), and a tensor held by two shards of an indexed checkpoint, are
    refused before loading, naming the tensor and both files."""
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "model-1.safetensors")
    save_file({"a": torch.zeros(2), "c": torch.ones(2)}, tmp_path / "model-2.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors", '
                     '"c": "model-2.safetensors", "a": "model-2.safetensors"}}')
    with pytest.raises(CheckpointError, match=r"tensor 'a' is listed twice, in "
                                              r"model-1\.safetensors and in model-2"):
        validate_checkpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors",
                                                "b": "model-1.safetensors",
                                                "c": "model-2.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"tensor 'a' is in both model-1\.safetensors and "
                                              r"model-2\.safetensors"):
        validate_checkpoint(tmp_path)
