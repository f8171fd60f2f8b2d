"""HF on the dequantized twin as the live reference of a quantized checkpoint
(`freetoken_verify.reference.twin`): golden and bisect pass on Qwen's block FP8, NVIDIA's
ModelOpt mixed NVFP4 + FP8 and RedHatAI's compressed-tensors NVFP4 at TP 1 and 2, an engine
bug fails golden at TP 1 (where only the reference can see it), the twin shares no code with
the engine's dequantizers, is built once, reused while the checkpoint is unchanged and
rebuilt when a quantized file changes, is the same from a sharded folder, and a cache
without the space is refused before any rank starts."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_run import assert_refused, failure_message, run_cli
from quant_folders import block_fp8, compressed_tensors_nvfp4, modelopt_mixed, split_in_two
from safetensors.torch import load_file, save_file

import freetoken_verify.reference.twin as twin_cache
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import twin_bytes, write_dequantized_twin
from freetoken.loading.checkpoint import CheckpointReader, layer_index
from freetoken_verify.cases.catalogue import hf_reference, load_reference, resolve_case
from freetoken_verify.checks.base import VerifyOptions
from freetoken_verify.reference.sources import hf_model
from freetoken_verify.reference.store import fingerprint
from freetoken_verify.running.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
SCALE = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {"block-fp8": block_fp8("tiny-qwen3.5-moe", root / "fp8"),
            "modelopt-mixed": modelopt_mixed(root / "mixed"),
            "ct-nvfp4": compressed_tensors_nvfp4(root / "ct")}


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


def test_golden_and_bisect_pass_on_every_quantized_layout(capsys, folders, tmp_path):
    """One run over the three layouts at TP 1 and 2: every golden and bisect row passes
    against HF on the twin (fp32 logits within 1e-4, bisect comparing each module with HF,
    the split GDN in_proj and in_proj_ba included), and the report names each model's
    reference: live HF on the twin, with its key and folder in the cache."""
    report = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "--model", ",".join(map(str, folders.values())), "--tp",
                             "1,2", "--checks", "golden,bisect", "--report-json", str(report))
    assert code == 0, out + err
    doc = _report(report)
    rows = {(r["model"], r["check"], r["tp"]): r for r in doc["results"]}
    assert len(rows) == 12 and all(r["status"] == "pass" for r in rows.values()), out
    for (model, check, tp), r in rows.items():
        if check == "golden":
            assert r["metrics"]["max_abs"] < 1e-4, (model, tp, r["metrics"])
        else:
            assert "HF" in r["metrics"]["references"], (model, tp, r["metrics"])
    table = {t["module"]: t for t in rows[(str(folders["block-fp8"]), "bisect", 1)]["metrics"]
             ["table"]}
    for module in ("linear_attn.in_proj", "linear_attn.in_proj_ba"):
        assert table[f"prefill/model.layers.0.{module}"]["vs_hf"] is not None, module
    for entry in doc["models"]:
        twin = entry["twin"]
        assert entry["reference"] == "hf" and twin["dtype"] == "float32", entry
        want = twin_cache.twin_key(resolve_case(entry["name"]), None)
        assert twin["key"] == want and Path(twin["path"]).name == want, entry
        assert (Path(twin["path"]) / twin_cache.MANIFEST).is_file(), entry


def test_an_engine_bug_fails_golden_against_the_twin_at_tp1(capsys, folders):
    """NVFP4 gate/up global scales swapped at load (injected into the engine's ranks only) in
    the compressed-tensors checkpoint: golden fails at TP 1, where no TP comparison exists
    and only HF on the twin sees it, and bisect names the routed experts."""
    code, out, _ = run_cli(capsys, "--model", str(folders["ct-nvfp4"]), "--tp", "1",
                           "--checks", "golden", "--inject", "nvfp4-load-globals-swapped")
    assert code == 1, out
    row = next(line for line in out.splitlines() if " golden " in line)
    assert "FAIL" in row and "mlp.experts" in failure_message(
        out, str(folders["ct-nvfp4"]), "golden", 1), out


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_twin_shares_no_code_with_the_engines_dequantizers(folders, tmp_path,
                                                               monkeypatch):
    """The twin's modules import none of the engine's format dequantizers, layers, kernels
    or loader, and a twin is still written, whole and unquantized, with every engine
    dequantizer made to raise: a bug there cannot also be in the reference."""
    engine = ("freetoken.formats.nvfp4", "freetoken.formats.fp8", "freetoken.layers",
              "freetoken.kernels", "freetoken.loading")
    for name in ("dequantize", "twin", "folder"):
        found = [m for m in _imports(ROOT / "freetoken/formats/quant" / f"{name}.py")
                 if m.startswith(engine)]
        assert not found, f"formats/quant/{name}.py imports {found}"

    import freetoken.formats.fp8.block as fp8_block
    import freetoken.formats.nvfp4.format as nvfp4_format

    def refuse(*args, **kwargs):
        raise AssertionError("the twin called an engine dequantizer")

    for module, names in ((fp8_block, ("dequantize", "expand")),
                          (nvfp4_format, ("dequantize", "e2m1_table", "unpack_nibbles"))):
        for name in names:
            monkeypatch.setattr(module, name, refuse)
    for label, folder in folders.items():
        twin = write_dequantized_twin(folder, tmp_path / label, read_quant_config(folder))
        tensors = load_file(twin / "model.safetensors")
        assert all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors.values()), label
        assert not [n for n in tensors if "scale" in n.rpartition(".")[2]], label


def test_a_sharded_folder_builds_the_same_twin(folders, tmp_path):
    """Each checkpoint split into two files and an index, the cut between a module's weight
    and its scale, gives a twin with the same tensors bit for bit; a twin cut into several
    files gets an index the engine's reader and HF follow to the same weights."""
    for label in ("block-fp8", "ct-nvfp4"):
        folder = folders[label]
        split = split_in_two(folder, tmp_path / f"{label}-split")
        scheme = read_quant_config(folder)
        whole = load_file(write_dequantized_twin(folder, tmp_path / f"{label}-twin", scheme)
                          / "model.safetensors")
        many = write_dequantized_twin(split, tmp_path / f"{label}-split-twin", scheme,
                                      max_file_bytes=1 << 19)
        assert (many / "model.safetensors.index.json").is_file(), sorted(many.iterdir())
        assert len(list(many.glob("model-*.safetensors"))) > 2, sorted(many.iterdir())
        reader = CheckpointReader(many)
        assert sorted(reader.names()) == sorted(whole), label
        for name, want in whole.items():
            assert torch.equal(reader.get(name), want), f"{label} {name}"
        assert twin_bytes(split, scheme) >= sum(p.stat().st_size
                                                for p in many.glob("model-*.safetensors"))
    # HF follows the index of a twin in several files (a real checkpoint's twin always is).
    from transformers import AutoModelForCausalLM

    one, several = (AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32)
                    .state_dict() for name in ("ct-nvfp4-twin", "ct-nvfp4-split-twin"))
    assert one.keys() == several.keys()
    assert all(torch.equal(one[k], several[k]) for k in one), "HF loaded other weights"


def test_the_twin_is_reused_when_unchanged_and_rebuilt_when_a_quantized_file_changes(
        folders, tmp_path, monkeypatch):
    """A truncated run builds a twin of its layers only (its config saying so); the first
    full-depth request builds the twin, the next reuses it (same key, folder untouched), and
    a truncated run then uses it; a block scale doubled in the quantized file gives a new key
    and a new twin whose weight is doubled there, the old twin kept."""
    monkeypatch.setenv(twin_cache.CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "fp8"
    shutil.copytree(folders["block-fp8"], folder)
    case = resolve_case(str(folder))
    short = twin_cache.twin_for(case, 1)
    layers = {layer_index(n) for n in load_file(short.folder / "model.safetensors")}
    assert layers == {None, 0}, layers
    config = json.loads((short.folder / "config.json").read_text())["text_config"]
    assert config["num_hidden_layers"] == 1 and len(config["layer_types"]) == 1, config
    first = twin_cache.twin_for(case, None)
    assert first.key != short.key
    built = (first.folder / twin_cache.MANIFEST).stat().st_mtime_ns
    again = twin_cache.twin_for(case, None)
    assert not first.reused and again.reused and again.key == first.key, (first, again)
    assert (again.folder / twin_cache.MANIFEST).stat().st_mtime_ns == built
    assert twin_cache.twin_for(case, 1).folder == first.folder
    assert twin_cache.planned_twin(case, None)["cached"] is True

    tensors = load_file(folder / "model.safetensors")
    tensors[SCALE] = tensors[SCALE] * 2
    save_file(tensors, folder / "model.safetensors")
    changed = twin_cache.twin_for(resolve_case(str(folder)), None)
    assert not changed.reused and changed.key != first.key, (first, changed)
    weight = SCALE.replace("weight_scale_inv", "weight")
    old = load_file(first.folder / "model.safetensors")
    new = load_file(changed.folder / "model.safetensors")
    assert torch.equal(new[weight], 2 * old[weight]), weight
    assert all(torch.equal(new[n], old[n]) for n in old if n != weight)
    assert (first.folder / twin_cache.MANIFEST).is_file()


def test_a_cache_without_the_space_is_refused_before_any_rank(capsys, folders, tmp_path,
                                                              monkeypatch):
    """Not enough free space: exit 2 naming the cache folder and the twin's bytes, before any
    rank starts; a cache folder under a regular file likewise; a run that computes no HF
    reference (shards) needs no twin and is not refused."""
    root = tmp_path / "cache"
    monkeypatch.setenv(twin_cache.CACHE_ENV, str(root))
    monkeypatch.setattr(twin_cache, "free_bytes", lambda folder: 1000)
    folder = folders["block-fp8"]
    need = twin_bytes(folder, read_quant_config(folder))
    assert_refused(capsys, ["--model", str(folder), "--tp", "1", "--checks", "golden"],
                   f"needs {need} bytes", str(root), "1000 bytes")
    assert_refused(capsys, ["--model", str(folder), "--tp", "1", "--checks", "bisect"],
                   f"needs {need} bytes", str(root))
    assert build_plan(models=[str(folder)], tp=[1], checks=["shards"]).cases
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(twin_cache.CACHE_ENV, str(tmp_path / "file" / "twins"))
    assert_refused(capsys, ["--model", str(folder), "--tp", "1", "--checks", "golden"],
                   str(tmp_path / "file"), "is not a directory")


def test_a_saved_reference_records_the_twin_and_refuses_a_changed_quantized_file(
        capsys, folders, tmp_path, monkeypatch):
    """--save-reference on a quantized checkpoint truncated to 2 layers computes HF on the
    twin of those layers, stores the quantized files' fingerprints and the twin's key, and
    golden passes against it; reusing it after a scale changed in the quantized file is
    refused naming the file."""
    # A cache of its own: a full-depth twin of the same checkpoint would serve the run.
    monkeypatch.setenv(twin_cache.CACHE_ENV, str(tmp_path / "cache"))
    folder, store = tmp_path / "fp8", tmp_path / "store"
    shutil.copytree(folders["block-fp8"], folder)
    code, out, err = run_cli(capsys, "--model", str(folder), "--tp", "1", "--checks",
                             "golden", "--num-layers", "2", "--save-reference", str(store))
    assert code == 0, out + err
    meta = json.loads((store / "reference.json").read_text())
    assert meta["weights"]["model.safetensors"] == fingerprint(folder / "model.safetensors")
    assert meta["twin"]["key"] == twin_cache.twin_key(resolve_case(str(folder)), 2)
    assert meta["twin"]["num_layers"] == 2, meta["twin"]
    twin_weights = Path(meta["twin"]["path"]) / "model.safetensors"
    assert fingerprint(twin_weights) != meta["weights"]["model.safetensors"]
    tensors = load_file(folder / "model.safetensors")
    tensors[SCALE] = tensors[SCALE] * 2
    save_file(tensors, folder / "model.safetensors")
    assert_refused(capsys, ["--model", str(folder), "--reference", str(store), "--tp", "1",
                            "--checks", "golden", "--num-layers", "2"],
                   str(folder / "model.safetensors"), "differs")


def test_live_hf_on_the_twin_reproduces_the_bundled_nvfp4_golden():
    """The bundled NVFP4 case's stored golden was HF on its dequantized experts: HF loaded
    from the twin gives the same logits on its prompts (float32 noise) and greedy ids."""
    case = resolve_case("tiny-qwen3.5-moe-nvfp4")
    meta, stored = load_reference(case.folder)
    model = hf_model(case, VerifyOptions(reference="hf"), torch.float32, "cpu")
    assert twin_cache.cached_twin(case, None) is not None
    live = hf_reference(model, meta["prompts"], meta["num_greedy"])
    for i in range(len(meta["prompts"])):
        torch.testing.assert_close(live[f"prefill_logits_{i}"], stored[f"prefill_logits_{i}"],
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(live[f"greedy_ids_{i}"], stored[f"greedy_ids_{i}"]), i
