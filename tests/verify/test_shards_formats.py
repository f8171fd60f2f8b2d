"""The shards check on quantized checkpoints in every shipping layout
(`quant_folders.layout_folders`): without faults every tensor has a statement from the config
alone and every rank's planned and loaded shard is what it states, bit for bit (fp8 bytes
included), at TP 1, 2, 4 and 8.
With each scale-layout bug injected (`freetoken_verify.faults.scales`) the check fails
naming the tensor, the rank, the engine parameter slot and what was expected; TP-only bugs
leave TP 1 green. A float8 checkpoint that lost its quantization config, and a module whose
stored dtype is not its declared format, fail naming the tensor.

The pass runs the harness in process over every folder at once (one rank group per TP size);
the faults run the shards audit in this process, one rank at a time, with the engine's own
loader where the bug is in loading, so no rank group is started for them."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from quant_folders import layout_folders

import freetoken.engine.core as core
from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.fp8.interleaved import InterleavedBlockRows
from freetoken.formats.fp8.specs import BlockScaleSplit
from freetoken.loading import CheckpointReader, loader
from freetoken.models import registry
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.checks import engine_cache
from freetoken_verify.checks.shards import check as shards
from freetoken_verify.cli import main
from freetoken_verify.faults import FAULTS

L = "model.language_model.layers"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return layout_folders(tmp_path_factory.mktemp("quantized"))


def _audit(folder, tp: int, rank: int = 0, loaded: bool = False) -> list[str]:
    """Rank `rank` of `tp`'s shards failures, in this process; `loaded`: with the rank's
    model loaded by the engine's loader first (as after memory or golden)."""
    engine_args = {"folder": str(folder), "dtype": "auto", "num_layers": None}
    reset_tp_info()
    set_tp_info(TPInfo(rank, tp))
    try:
        state = {}
        if loaded:
            cfg = load_config(folder)
            model = build_model(cfg)
            core.load_weights(model, CheckpointReader(folder, None), shard_plan(cfg, tp),
                              progress=False)
            state = {"engine": SimpleNamespace(model=model),
                     "engine_key": engine_cache._key(engine_args)}
        return shards._audit(SimpleNamespace(rank=rank, size=tp, state=state),
                             engine_args)["failures"]
    finally:
        reset_tp_info()


def test_every_format_matches_its_layout_at_every_tp_size(capsys, tmp_path, folders):
    """memory loads each engine, then shards: every tensor stated, every rank's planned and
    loaded shard as stated, at TP 1, 2, 4 and 8, for block FP8 (Qwen3.5-MoE, Qwen3,
    Qwen3-MoE, Llama), ModelOpt FP8 and NVFP4 (Llama), ModelOpt mixed and compressed-tensors
    NVFP4 (Qwen3.5-MoE)."""
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*[a for f in folders.values() for a in ("--model", str(f))], "--tp", "1,2,4,8",
              "--checks", "memory,shards", "--report-json", str(report)])
    capsys.readouterr()
    rows = [r for r in json.loads(report.read_text())["results"] if r["check"] == "shards"]
    assert exit_info.value.code == 0, [r["message"] for r in rows if r["status"] != "pass"]
    assert len(rows) == len(folders) * 4
    for r in rows:
        m = r["metrics"]
        assert r["status"] == "pass" and m["stated"] == m["tensors"] - m["ignored"] > 0, r
        assert m["loaded_compared"] == m["stated"] * r["tp"], r


# (fault, folder, TP, rank audited, engine loaded first, TP 1 green, words of the failure)
FAULT_CASES = [
    ("fp8-scale-first-segment", "modelopt-mixed", 2, 0, False, False,
     f"{L}.0.linear_attn.in_proj_z.weight_scale: the plan writes it to model.layers.0"
     ".linear_attn.in_proj.weight_scale[0], the layout says model.layers.0.linear_attn"
     ".in_proj.weight_scale[1]"),
    ("block-scale-rank-offset", "block-fp8-qwen3.5", 8, 0, False, True,
     f"{L}.0.mlp.experts.0.gate_proj.weight_scale_inv rank 1 (planned for model.layers.0.mlp"
     ".experts.w13_weight_scale[0, 0:1]): local row 0 holds global block row 1 (rows 24..31: "
     "gate), expected global block row 0 (rows 0..23: gate); 1 / 1 rows wrong"),
    ("block-scale-shared-neighbour", "block-fp8-qwen3.5", 8, 7, True, True,
     f"{L}.0.mlp.experts.0.gate_proj.weight_scale_inv rank 7 (loaded model.layers.0.mlp"
     ".experts.w13_weight_scale[0, 0:1]): local row 0 holds zeros, expected global block row "
     "1 (rows 24..31: gate)"),
    ("q-gate-scale-rows-unmoved", "block-fp8-qwen3.5", 2, 0, False, False,
     f"{L}.1.self_attn.q_proj.weight_scale_inv rank 0 (planned for model.layers.1.self_attn"
     ".qkv_proj.weight_scale[0:256]): local row 32 holds global block row 1 (rows 24..47: q, "
     "head 0 to gate, head 0), expected global block row 2 (rows 48..71: gate, head 0 to q, "
     "head 1)"),
    ("nvfp4-global-first-segment", "ct-nvfp4", 2, 1, True, False,
     f"{L}.1.self_attn.k_proj.weight_global_scale rank 1 (loaded model.layers.1.self_attn"
     f".qkv_proj.weight_scale_2[1]): holds "),
]


@pytest.fixture
def isolated(monkeypatch):
    """Every engine attribute a scale fault replaces, restored after the test."""
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))
    monkeypatch.setattr(loader, "POST_LOAD_HOOKS", [])
    for owner, attr in ((BlockScaleSplit, "_span"), (BlockScaleSplit, "shard"),
                        (BlockScaleSplit, "pieces"), (InterleavedBlockRows, "shard"),
                        (InterleavedBlockRows, "pieces")):
        monkeypatch.setattr(owner, attr, getattr(owner, attr))


@pytest.mark.parametrize("fault, folder, tp, rank, loaded, tp1_green, words", FAULT_CASES,
                         ids=[c[0] for c in FAULT_CASES])
def test_each_scale_layout_bug_is_caught_and_named(isolated, folders, fault, folder, tp, rank,
                                                   loaded, tp1_green, words):
    """With the fault injected, rank `rank` of `tp` reports a failure with these words (the
    tensor, rank, parameter slot, what it holds and what it should); TP 1 stays clean for a
    TP-only bug and fails too for one that bites at any size."""
    assert not _audit(folders[folder], tp, rank, loaded), "fails before the fault"
    FAULTS[fault]()
    failures = _audit(folders[folder], tp, rank, loaded)
    assert any(words in f for f in failures), f"{fault}: no failure says {words!r}: {failures}"
    assert (not _audit(folders[folder], 1, 0, loaded)) == tp1_green, fault


def test_nvfp4_global_fault_says_which_segments_value_is_held(isolated, folders):
    """A loaded global scale that is another segment's names that segment's tensor and both
    values."""
    FAULTS["nvfp4-global-first-segment"]()
    failures = _audit(folders["ct-nvfp4"], 2, 0, loaded=True)
    v = [f for f in failures if f.startswith(f"{L}.1.self_attn.v_proj.weight_global_scale")]
    assert v and f"({L}.1.self_attn.q_proj.weight_global_scale's value), expected " in v[0] \
        and v[0].endswith("(the checkpoint's)"), failures


def test_float8_checkpoint_without_its_config_is_refused_naming_the_tensor(folders, tmp_path):
    """Qwen's block-FP8 folder with its quantization_config and scales gone (a float8
    checkpoint that lost its config): every float8 weight fails as quantized data in an
    unquantized module; with the scales still there they fail too, as tensors no format of
    their module writes."""
    bare = tmp_path / "bare"
    shutil.copytree(folders["block-fp8-qwen3.5"], bare)
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    failures = _audit(bare, 2)
    assert f"{L}.0.linear_attn.in_proj_qkv.weight is float8_e4m3fn, but with no quantization " \
        "config its module is bf16 (unquantized), which stores weight as an unquantized " \
        "float" in failures, failures
    assert any(f.startswith(f"{L}.0.linear_attn.in_proj_qkv.weight_scale_inv: with no "
                            "quantization config") for f in failures), failures


def test_a_module_stored_in_another_format_than_declared_fails(folders, tmp_path):
    """ModelOpt mixed with layer 3's o_proj left out of quantized_layers (so declared bf16)
    while its weight is still FP8: the weight fails naming it, the declaring file and the
    format; so do its scales."""
    folder = tmp_path / "undeclared"
    shutil.copytree(folders["modelopt-mixed"], folder)
    doc = json.loads((folder / "hf_quant_config.json").read_text())
    del doc["quantization"]["quantized_layers"][f"{L}.3.self_attn.o_proj"]
    (folder / "hf_quant_config.json").write_text(json.dumps(doc))
    failures = _audit(folder, 2)
    o_proj = f"{L}.3.self_attn.o_proj"
    assert f"{o_proj}.weight is float8_e4m3fn, but {folder / 'hf_quant_config.json'} makes " \
        "its module bf16 (unquantized), which stores weight as an unquantized float" in \
        failures, failures
    assert any(f.startswith(f"{o_proj}.weight_scale: ") for f in failures), failures


def test_float8_round_trips_compare_bytes():
    """CPU torch compares float8 only partly (`torch.equal` of a float8 tensor with itself
    raises; value comparisons call +0 and -0 equal): the round trip and replication checks
    compare bytes, so a tensor equals itself, one changed e4m3 byte is found and counted,
    and +0 and -0 differ."""
    values = torch.arange(1, 49, dtype=torch.float32).reshape(6, 8) / 8
    full = values.to(torch.float8_e4m3fn)
    values[2, 3] = -values[2, 3]
    off = values.to(torch.float8_e4m3fn)
    assert shards._same_bits(full, full) and not shards._same_bits(full, off)
    assert shards._diff(off, full) == "1 / 48 elements differ"
    assert not shards._same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
