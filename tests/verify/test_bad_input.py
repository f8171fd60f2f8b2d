"""Bad input to `freetoken-verify` is refused before any rank starts: exit 2 and one line
`error: ...` naming the option, file or tensor, never a traceback, never exit 0 or 1. Covers
options, report paths, config types and ranges, damaged safetensors files and indexes, broken
quantization configs and modified bundled cases."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest
import torch
from cli_run import assert_refused
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

_INDEX = "model.safetensors.index.json"




def _make_copy(tmp_path: Path, case: str = "tiny-llama") -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / case, folder)
    (folder / "meta.json").unlink()
    return folder


def _make_sharded(tmp_path: Path) -> Path:
    """tiny-llama split into two files with an index, like a large checkpoint."""
    folder = _make_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _edit_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(raw) == length, "edited header must keep its length"
    path.write_bytes(data[:8] + raw + data[8 + length:])


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / _INDEX).read_text())
    edit(index)
    (folder / _INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("args, needles", [
    (["--model", ""], ["--model: empty value"]),
    (["--model", "tiny-llama,"], ["--model: empty value"]),
    (["--checks", ""], ["--checks: empty value"]),
    (["--tp", ""], ["--tp: empty value"]),
    (["--tp", "\u00b2"], ["--tp: '\u00b2' is not a TP size"]),
    (["--tp", "-2"], ["--tp: '-2' is not a TP size"]),
    (["--timeout", "0"], ["--timeout", "'0'"]),
    (["--timeout", "-5"], ["--timeout", "'-5'"]),
    (["--timeout", "nan"], ["--timeout", "'nan'"]),
    (["--timeout", "inf"], ["--timeout", "'inf'"]),
    (["--num-layers", "0"], ["--num-layers", "'0'"]),
    (["--num-layers", "\u0663"], ["--num-layers"]),
])
def test_bad_options_are_refused(capsys, args, needles):
    """Empty, non-positive, non-finite and non-ASCII-digit option values: exit 2, one line."""
    assert_refused(capsys, ["--model", "tiny-llama", *args], *needles)


def test_report_paths_are_checked_before_the_run(capsys, tmp_path):
    """An unwritable report path (under a regular file) and the same path for both reports are
    refused up front, not after the run."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_refused(capsys, ["--model", "tiny-llama", "--report-json", str(blocker / "r.json")],
                   "--report-json", "is not a directory")
    same = str(tmp_path / "r.out")
    assert_refused(capsys, ["--model", "tiny-llama", "--report-json", same, "--junit-xml", same],
                   "same file")
    assert_refused(capsys, ["--model", "tiny-llama", "--junit-xml", str(tmp_path)],
                   "--junit-xml", "is a directory")


def _make_special_files(tmp_path: Path) -> dict[str, Path]:
    """A private character device (a copy of /dev/null's node, where this user may create
    one), a named pipe and a bound unix socket under `tmp_path`."""
    import socket

    made = {}
    null = os.stat("/dev/null")
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, null.st_rdev)
        made["a character device"] = tmp_path / "null"
    except PermissionError:
        pass
    os.mkfifo(tmp_path / "pipe")
    made["a named pipe"] = tmp_path / "pipe"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    sock.close()
    made["a socket"] = tmp_path / "sock"
    return made


def test_reports_are_written_only_to_regular_files(capsys, tmp_path):
    """A device, a named pipe or a socket at a report path is refused before any rank starts,
    naming what it is, and left as it was (the atomic rename replaced a private copy of
    /dev/full with a regular file, exit 0)."""
    for kind, path in _make_special_files(tmp_path).items():
        before = os.lstat(path)
        for option in ("--report-json", "--junit-xml", "--summary-md"):
            assert_refused(capsys, ["--model", "tiny-llama", option, str(path)], option,
                           f"is {kind}", "regular files")
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), kind


@pytest.mark.parametrize("changes, needles", [
    ({"num_attention_heads": "8"}, ["config.json", "num_attention_heads must be an integer"]),
    ({"num_attention_heads": 0}, ["num_attention_heads must be >= 1"]),
    ({"hidden_size": []}, ["hidden_size must be an integer, got []"]),
    ({"vocab_size": -301}, ["vocab_size must be >= 1"]),
    ({"rms_norm_eps": 0}, ["rms_norm_eps must be a finite number above 0"]),
])
def test_config_types_and_ranges_are_refused(capsys, tmp_path, changes, needles):
    """config.json values of the wrong type or out of range name the key and the file."""
    folder = _make_copy(tmp_path)
    _edit_config(folder, **changes)
    assert_refused(capsys, ["--model", str(folder), "--tp", "1"], *needles)


def test_hybrid_config_types_are_refused(capsys, tmp_path):
    """Qwen3.5-MoE's own keys are typed too: GatedDeltaNet heads as a string are refused."""
    folder = _make_copy(tmp_path, "tiny-qwen3.5-moe")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    text["linear_num_key_heads"] = "8"
    (folder / "config.json").write_text(json.dumps(config))
    assert_refused(capsys, ["--model", str(folder), "--tp", "1"], "config.json",
                   "linear_num_key_heads must be a positive integer, got '8'")


def test_broken_quant_config_is_named(capsys, tmp_path):
    """A broken hf_quant_config.json is reported as that file, not as config.json; a list
    where module names belong is refused rather than split into characters."""
    folder = _make_copy(tmp_path, "tiny-qwen3.5-moe-nvfp4")
    quant = folder / "hf_quant_config.json"
    good = json.loads(quant.read_text())
    quant.write_text("{not json")
    assert_refused(capsys, ["--model", str(folder), "--tp", "1"], "hf_quant_config.json",
                   "invalid JSON")
    good["quantization"]["exclude_modules"] = "lm_head"
    quant.write_text(json.dumps(good))
    assert_refused(capsys, ["--model", str(folder), "--tp", "1"], "hf_quant_config.json",
                   "exclude_modules must be a list")


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _garbage_json(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))


def _unknown_dtype(path: Path) -> None:
    def edit(header):
        name = next(k for k in header if k != "__metadata__")
        header[name]["dtype"] = "X9"
    _edit_header(path, edit)


@pytest.mark.parametrize("damage, needles", [
    (lambda p: _truncate(p), ["model.safetensors", "truncated"]),
    (lambda p: _truncate(p, 0.0000001), ["model.safetensors", "too short"]),
    (lambda p: p.write_bytes(b"\xff" * 64 + p.read_bytes()[64:]), ["header length"]),
    (_garbage_json, ["unreadable safetensors header"]),
    (_unknown_dtype, ["unknown dtype 'X9'"]),
])
def test_damaged_single_file_is_refused(capsys, tmp_path, damage, needles):
    """A truncated file, a garbage header and an unknown dtype are found from the header
    before any rank starts, naming the file (and the tensor where there is one)."""
    folder = _make_copy(tmp_path)
    damage(folder / "model.safetensors")
    assert_refused(capsys, ["--model", str(folder), "--tp", "1"], *needles)


@pytest.mark.parametrize("damage, needles", [
    (lambda f: _truncate(f / "model-00002-of-00002.safetensors"),
     ["model-00002-of-00002.safetensors", "truncated"]),
    (lambda f: _edit_index(f, lambda i: i.pop("weight_map")), [_INDEX, "no `weight_map`"]),
    (lambda f: (f / "model-00001-of-00002.safetensors").unlink(),
     ["model-00001-of-00002.safetensors, which is missing"]),
    (lambda f: _edit_index(f, lambda i: i["weight_map"].update(
        {"model.norm.weight": "model-00001-of-00002.safetensors",
         "model.extra.weight": "model-00002-of-00002.safetensors"})), ["does not hold it"]),
])
def test_damaged_indexed_checkpoint_is_refused(capsys, tmp_path, damage, needles):
    """Indexed checkpoints: a truncated second shard, an index without weight_map, a missing
    file and a tensor the index puts in a file that lacks it are each named."""
    folder = _make_sharded(tmp_path)
    damage(folder)
    assert_refused(capsys, ["--model", str(folder), "--tp", "1"], *needles)


def test_modified_bundled_case_is_bad_input(capsys, tmp_path, monkeypatch):
    """A bundled case whose weights no longer match meta.json's sha256 is bad input (exit 2
    naming the file), not an engine bug found by golden."""
    import freetoken_verify.cases.catalogue

    root = tmp_path / "golden"
    shutil.copytree(GOLDEN / "tiny-llama", root / "tiny-llama")
    weights = root / "tiny-llama" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(freetoken_verify.cases.catalogue, "GOLDEN", root)
    assert_refused(capsys, ["--model", "tiny-llama", "--tp", "1"], "model.safetensors",
                   "does not match the sha256")


def test_float8_weights_without_a_quantization_config_are_refused(capsys, tmp_path):
    """A float8 checkpoint that lost its quantization config (raw e4m3 weights, no scales):
    refused before any rank starts, naming the tensor and its dtype. Before, it loaded and
    golden passed against live HF, which reads the raw values the same way."""
    folder = tmp_path / "raw-fp8"
    shutil.copytree(GOLDEN / "tiny-llama", folder)
    (folder / "meta.json").unlink()
    (folder / "reference.safetensors").unlink()
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_refused(capsys, ["--model", str(folder), "--tp", "1,2", "--checks", "golden"],
                   name, "float8_e4m3fn", "no quantization config")
