"""A saved HF reference (`--save-reference DIR`, reused with `--reference DIR`) is what the
golden check compares with, and it is refused, before any rank starts (exit 2, one line naming
the file or option), for a checkpoint whose weights differ from the ones it was saved from and
for prompts, continuation length, depth or dtype it does not cover."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from cli_run import assert_refused, run_cli
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken_verify.cases.catalogue import resolve_case
from freetoken_verify.checks import VerifyOptions
from freetoken_verify.reference import store as reference_store
from freetoken_verify.reference.sources import live_hf_reference


def _make_checkpoint(tmp_path: Path, name: str = "ckpt") -> Path:
    """tiny-llama as a plain checkpoint folder (no bundled golden)."""
    folder = tmp_path / name
    shutil.copytree(GOLDEN / "tiny-llama", folder)
    for stored in ("meta.json", "reference.safetensors", "bisect.safetensors"):
        (folder / stored).unlink()
    return folder


def _make_store(capsys, tmp_path: Path, folder: Path, with_bisect: bool = False,
                **options) -> Path:
    """HF's reference of `folder` saved through the module (no rank processes); HF's own
    progress output is dropped so that the next command's stderr is its own."""
    store = tmp_path / "ref"
    opts = VerifyOptions(device="cpu", save_reference=str(store), **options)
    case = resolve_case(str(folder))
    reference_store.save_reference(live_hf_reference(case, opts, "cpu", with_bisect),
                                   case, opts, "cpu", store)
    capsys.readouterr()
    return store


def _flip_byte(path: Path, offset_from_end: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, 2)
        byte = f.read(1)[0]
        f.seek(-offset_from_end, 2)
        f.write(bytes([byte ^ 1]))


def test_saved_reference_is_what_golden_compares_with(capsys, tmp_path):
    """Reusing a saved reference passes on the same checkpoint, and fails once the saved
    logits are perturbed: the run reads the store instead of recomputing HF."""
    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder, max_new_tokens=4)
    args = ["--model", str(folder), "--tp", "1", "--checks", "golden", "--reference", str(store),
            "--report-json", str(tmp_path / "r.json")]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, out + err
    row = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert row["metrics"]["greedy_total"] == 4 * 3, "the saved continuation length is used"
    tensors = load_file(store / reference_store.TENSORS)
    tensors["prefill_logits_1"] = tensors["prefill_logits_1"] + 3.0 * tensors[
        "prefill_logits_1"].std()
    save_file(tensors, store / reference_store.TENSORS)
    code, out, err = run_cli(capsys, *args)
    assert code == 1 and "prompt 1" in out, f"perturbed saved logits must fail golden:\n{out}"


def test_changed_checkpoint_is_refused(capsys, tmp_path):
    """One flipped byte in the weights, a missing or an extra weights file: exit 2 naming the
    file."""
    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder)
    args = ["--model", str(folder), "--tp", "1", "--reference", str(store)]
    _flip_byte(folder / "model.safetensors")
    assert_refused(capsys, args, str(folder / "model.safetensors"), "differs")
    shutil.copy(GOLDEN / "tiny-llama" / "model.safetensors", folder / "model.safetensors")
    shutil.copy(folder / "model.safetensors", folder / "extra.safetensors")
    assert_refused(capsys, args, "extra.safetensors")
    (folder / "extra.safetensors").unlink()
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    assert_refused(capsys, args, "model.safetensors")


@pytest.mark.parametrize("extra, needle", [
    (["--seed", "5"], "requested prompts differ"),
    (["--max-new-tokens", "7"], "--max-new-tokens 7 differs"),
    (["--num-layers", "1"], "saved at full depth, this run uses --num-layers 1"),
    (["--dtype", "bfloat16"], "no bfloat16 baseline"),
    (["--model", "tiny-qwen3"], "exactly one --model"),
])
def test_run_the_store_does_not_cover_is_refused(capsys, tmp_path, extra, needle):
    """Prompts, continuation length, depth, a dtype without a saved baseline, or a second
    model: exit 2 with one line saying what differs."""
    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder, max_new_tokens=2)
    assert_refused(capsys, ["--model", str(folder), "--tp", "1", "--reference", str(store),
                             *extra], needle)


def test_save_reference_refusals(capsys, tmp_path):
    """--save-reference needs one model, a folder it may write, and a reference HF computes;
    --reference needs a choice or a folder holding a saved reference."""
    folder = _make_checkpoint(tmp_path)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    base = ["--model", str(folder), "--tp", "1"]
    assert_refused(capsys, [*base, "--save-reference", str(busy)], "holds other files")
    assert_refused(capsys, [*base, "--model", "tiny-qwen3", "--save-reference",
                             str(tmp_path / "s")], "exactly one --model")
    assert_refused(capsys, [*base, "--reference", "golden", "--save-reference",
                             str(tmp_path / "s")], "cannot be combined")
    assert_refused(capsys, [*base, "--reference", "hff"], "'hff' is neither auto, golden, hf")
    assert_refused(capsys, [*base, "--reference", str(busy)], "is not a saved reference")


def test_sampled_fingerprint_sees_header_size_and_sampled_bytes(tmp_path, monkeypatch):
    """Above FULL_HASH_LIMIT a file's fingerprint covers its size, its safetensors header and
    the sampled blocks: each change alters the digest; the same bytes give the same digest."""
    monkeypatch.setattr(reference_store, "FULL_HASH_LIMIT", 0)
    folder = _make_checkpoint(tmp_path)
    path = folder / "model.safetensors"
    first = reference_store.fingerprint(path)
    assert first["method"] == "sampled-sha256"
    assert reference_store.fingerprint(path) == first, "deterministic"
    _flip_byte(path, offset_from_end=1)
    assert reference_store.fingerprint(path)["digest"] != first["digest"], "last sampled block"
    tensors = load_file(GOLDEN / "tiny-llama" / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt", "note": "resaved"})
    assert reference_store.fingerprint(path)["digest"] != first["digest"], "header"


def test_incomplete_store_is_refused(capsys, tmp_path):
    """A store missing its tensors file or a field of reference.json is refused by name."""
    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder)
    args = ["--model", str(folder), "--tp", "1", "--reference", str(store)]
    saved = (store / reference_store.META).read_text()
    meta = json.loads(saved)
    del meta["weights"]
    (store / reference_store.META).write_text(json.dumps(meta))
    assert_refused(capsys, args, "has no 'weights'")
    (store / reference_store.META).write_text(saved)
    (store / reference_store.TENSORS).unlink()
    assert_refused(capsys, args, f"no {reference_store.TENSORS}")


def test_damaged_store_is_refused_as_a_whole_before_any_rank(capsys, tmp_path):
    """Every part of a saved reference is checked before any rank starts, naming the file and
    the field: a truncated reference.safetensors (was: ERROR rows with SafetensorError not
    naming the file), a weights entry that is not an object (was: a TypeError traceback), and
    an edited num_greedy (was: golden blaming the engine)."""
    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder)
    args = ["--model", str(folder), "--tp", "1", "--checks", "golden", "--reference", str(store)]
    meta_path, tensors = store / reference_store.META, store / reference_store.TENSORS
    saved, data = meta_path.read_text(), tensors.read_bytes()
    tensors.write_bytes(data[: len(data) * 2 // 3])
    assert_refused(capsys, args, str(tensors), "is unreadable")
    tensors.write_bytes(data)
    for field, value, needle in (("weights", {"model.safetensors": 3}, "'weights' is not"),
                                 ("weights", [1], "'weights' is not"),
                                 ("prompts", [[1, "x"]], "'prompts' is not"),
                                 ("num_layers", 0, "'num_layers' is not"),
                                 ("num_greedy", "16", "'num_greedy' is not")):
        meta = json.loads(saved)
        meta[field] = value
        meta_path.write_text(json.dumps(meta))
        assert_refused(capsys, args, str(meta_path), needle)
    meta = json.loads(saved)
    meta["num_greedy"] += 3
    meta_path.write_text(json.dumps(meta))
    assert_refused(capsys, args, "tensor 'greedy_ids_0'", f"expected {meta['num_greedy']} rows")


def test_hf_failing_to_load_is_blamed_on_hf_not_the_folder(capsys, tmp_path):
    """--save-reference on a checkpoint HF cannot load (two shards and no index) says HF could
    not compute the reference; it said `cannot write DIR (Error no file named ...)`."""
    folder = _make_checkpoint(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({k: tensors[k] for k in part}, folder / f"model-0000{i + 1}-of-00002.safetensors",
                  metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    out = tmp_path / "ref"
    code, _, err = run_cli(capsys, "--model", str(folder), "--tp", "1", "--checks", "golden",
                           "--save-reference", str(out))
    assert code == 2 and "HF transformers could not compute the reference" in err, (code, err)
    assert "cannot write" not in err, err


def test_broken_bisect_part_of_a_store_is_refused(capsys, tmp_path):
    """A truncated bisect.safetensors or a malformed bisect entry: exit 2 naming it, before
    any rank starts."""
    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder, with_bisect=True)
    args = ["--model", str(folder), "--tp", "1", "--checks", "bisect", "--reference", str(store)]
    saved = (store / reference_store.META).read_text()
    meta = json.loads(saved)
    meta["bisect"]["token"] = "x"
    (store / reference_store.META).write_text(json.dumps(meta))
    assert_refused(capsys, args, "malformed 'bisect' entry")
    (store / reference_store.META).write_text(saved)
    data = (store / reference_store.BISECT).read_bytes()
    (store / reference_store.BISECT).write_bytes(data[: len(data) // 2])
    assert_refused(capsys, args, "bisect.safetensors is missing or unreadable")


def test_save_reference_from_the_command_line(capsys, tmp_path):
    """`--save-reference DIR` writes the store before the ranks start (prompts, continuation
    length, versions, source, each weights file's sha256) and the run then passes against it."""
    from freetoken_verify.cases.catalogue import sha256_file

    folder = _make_checkpoint(tmp_path)
    store = tmp_path / "saved"
    code, out, err = run_cli(capsys, "--model", str(folder), "--tp", "1", "--checks", "golden",
                          "--max-new-tokens", "2", "--seed", "4", "--save-reference", str(store))
    assert code == 0, out + err
    assert err.index("computing HF's reference") < err.index("starting"), err
    meta = json.loads((store / reference_store.META).read_text())
    assert meta["num_greedy"] == 2 and meta["seed"] == 4 and len(meta["prompts"]) == 3
    assert meta["source"] == {"path": str(folder.resolve())} and meta["transformers"]
    assert meta["weights"] == {"model.safetensors": {
        "size": (folder / "model.safetensors").stat().st_size, "method": "sha256",
        "digest": sha256_file(folder / "model.safetensors")}}
    # Every file of the store has the mode the umask gives (safetensors alone writes 0600).
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in store.iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, modes


def test_low_precision_baseline_is_saved_per_dtype(capsys, tmp_path):
    """Saved with --dtype bfloat16, the store carries HF's bf16 baseline per prompt: a bf16
    run reuses it with that baseline, a float16 run is refused."""
    import torch

    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder, dtype="bfloat16")
    case = resolve_case(str(folder))
    options = VerifyOptions(device="cpu", dtype="bfloat16", reference=str(store))
    reference_store.check_store(store, case, options, None, torch.bfloat16)
    ref = reference_store.stored_reference(store, case, options)
    assert ref.source == "stored" and len(ref.baseline) == len(ref.prompts)
    assert all(0 < b.rel_l2 < 0.5 for b in ref.baseline), ref.baseline
    with pytest.raises(reference_store.StoreError, match="no float16 baseline"):
        reference_store.check_store(store, case, options, None, torch.float16)


def test_saved_reference_keeps_hf_activations_on_the_bisect_prompt(capsys, tmp_path):
    """The store holds HF's per-module outputs on the bisect prompt and HF's first greedy
    token after it, in float32 and at the engine's low precision."""
    from freetoken_verify.reference.sources import bisect_prompt_of

    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder, with_bisect=True, dtype="bfloat16")
    meta = reference_store.read_meta(store)
    saved = reference_store.stored_bisect(store)
    assert saved.prompt == bisect_prompt_of(meta["prompts"]) == meta["bisect"]["prompt"]
    assert sorted(saved.by_dtype) == ["bfloat16", "float32"], sorted(saved.by_dtype)
    down = saved.by_dtype["float32"]["model.layers.1.mlp.down_proj"]
    assert down.shape[0] == len(saved.prompt) + 1, down.shape
    assert not torch.equal(down, saved.by_dtype["bfloat16"]["model.layers.1.mlp.down_proj"])


def test_bisect_localises_against_the_saved_activations_without_hf(capsys, tmp_path,
                                                                    monkeypatch):
    """With a saved reference, bisect compares every module with HF's saved outputs and never
    loads HF; a saved output made wrong is named as the first divergence."""
    import freetoken_verify.reference.sources

    folder = _make_checkpoint(tmp_path)
    store = _make_store(capsys, tmp_path, folder, with_bisect=True)

    def no_hf(*args, **kwargs):
        raise AssertionError("HF was loaded although the saved reference holds its outputs")

    monkeypatch.setattr(freetoken_verify.reference.sources, "hf_model", no_hf)
    report = tmp_path / "r.json"
    args = ["--model", str(folder), "--tp", "1", "--checks", "bisect", "--reference",
            str(store), "--report-json", str(report)]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, out + err
    row = json.loads(report.read_text())["results"][0]
    assert row["metrics"]["references"] == "HF" and row["metrics"]["modules"] > 10, row

    acts = load_file(store / reference_store.BISECT)
    acts["float32/model.layers.1.mlp.down_proj"] *= 1.5
    save_file(acts, store / reference_store.BISECT)
    code, out, err = run_cli(capsys, *args)
    assert code == 1 and "model.layers.1.mlp.down_proj" in out, out + err


def test_hf_runs_eager_attention_in_low_precision_under_scalar_kernels(monkeypatch):
    """Under ATEN_CPU_CAPABILITY=default torch's fused CPU attention refuses bf16 / fp16 on a
    CPU with AMX (it packs for AMX without the capability), so HF's model is loaded with its
    eager attention there; float32, the vector kernels and CUDA keep HF's default."""
    from freetoken_verify.reference.sources import _attention

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert _attention(torch.bfloat16, cpu) == _attention(torch.float16, "cpu") == {
        "attn_implementation": "eager"}
    assert _attention(torch.float32, cpu) == _attention(torch.bfloat16, "cuda") == {}
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert _attention(torch.bfloat16, cpu) == {}
