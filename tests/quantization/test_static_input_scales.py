"""Stored static input scales of FP8 modules (HF `fp8` `activation_scheme: static`:
`activation_scale`; compressed-tensors static input activations: `input_scale`): the config
says which modules store them, the engine loads them whole into `input_scale` parameters
(one entry per checkpoint tensor, an expert's `[e, gate | up]`), checked finite and above 0
naming the tensor, and leaves them unused; the harness states and counts them from the
config, and the dequantized twin drops them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import shards_audit
from quant_folders import block_fp8, compressed_tensors_fp8_llama, with_tensor
from safetensors.torch import load_file

import freetoken.engine.core as core
from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.fp8.tensor import ScalarScale
from freetoken.formats.quant import FP8_BLOCK, FP8_TENSOR, parse_quant_config, read_quant_config
from freetoken.formats.quant.format import QuantConfigError
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.loading import CheckpointReader
from freetoken.models import registry
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.cli import main
from freetoken_verify.faults._patch import rewrite_plans

L = "model.language_model.layers"
FP8_BLOCK_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "block",
                     "block_structure": [24, 40]}
FP8_INPUTS = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """Qwen's block FP8 over the bundled Qwen3.5-MoE, with static activation scales."""
    return block_fp8("tiny-qwen3.5-moe", tmp_path_factory.mktemp("q") / "s",
                     static_inputs=True)


@pytest.fixture(scope="module")
def ct_static(tmp_path_factory):
    """compressed-tensors FP8 block and per tensor on tiny-llama, static input scales."""
    root = tmp_path_factory.mktemp("ct")
    return {s: compressed_tensors_fp8_llama(root / s, s) for s in ("block", "tensor")}


def _ct(weights: dict, inputs: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": weights}
    if inputs is not None:
        group["input_activations"] = inputs
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}


def test_configs_say_which_modules_store_input_scales():
    """HF `static` and compressed-tensors `dynamic: false` inputs store them; `dynamic` and
    no input_activations do not; ModelOpt FP8 always does; the format's name says so."""
    hf = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    static = parse_quant_config({**hf, "activation_scheme": "static"}).format_of("m.q_proj")
    dynamic = parse_quant_config({**hf, "activation_scheme": "dynamic"}).format_of("m.q_proj")
    assert static.kind == FP8_BLOCK and static.input_scales and not dynamic.input_scales
    assert static.describe() == "FP8 block 128x128 (fp8, static input scales)"
    assert parse_quant_config(_ct(FP8_BLOCK_WEIGHTS, FP8_INPUTS)).format_of("x").input_scales
    tensor = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    ct_static = parse_quant_config(_ct(tensor, FP8_INPUTS)).format_of("x")
    assert ct_static.kind == FP8_TENSOR and ct_static.input_scales
    for inputs in (None, {**FP8_INPUTS, "dynamic": True}):
        assert not parse_quant_config(_ct(FP8_BLOCK_WEIGHTS, inputs)).format_of("x") \
            .input_scales
    modelopt = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}
    assert parse_quant_config(modelopt).format_of("x").input_scales
    with pytest.raises(QuantConfigError, match="input_activations is not an object"):
        parse_quant_config(_ct(FP8_BLOCK_WEIGHTS, "static"))


def _load(folder, tp: int = 1, rank: int = 0):
    reset_tp_info()
    set_tp_info(TPInfo(rank, tp))
    try:
        cfg = load_config(folder)
        model = build_model(cfg)
        core.load_weights(model, CheckpointReader(folder, None), shard_plan(cfg, tp),
                          progress=False)
        return dict(model.named_parameters())
    finally:
        reset_tp_info()


def test_static_block_fp8_loads_its_input_scales_whole_per_tensor(static):
    """Each checkpoint tensor's scale in its own entry: q | k | v, GDN qkv | z, the shared
    expert's gate | up, each routed expert's gate | up and down; at TP 2 every rank holds
    them whole."""
    stored = load_file(static / "model.safetensors")
    for rank in (0, 1):
        params = _load(static, 2, rank)
        attn = params["model.layers.3.self_attn.qkv_proj.input_scale"]
        want = [stored[f"{L}.3.self_attn.{x}_proj.activation_scale"] for x in "qkv"]
        assert torch.equal(attn, torch.stack(want).float())
        gdn = params["model.layers.0.linear_attn.in_proj.input_scale"]
        assert torch.equal(gdn, torch.stack([
            stored[f"{L}.0.linear_attn.in_proj_{x}.activation_scale"] for x in ("qkv", "z")]))
        w13 = params["model.layers.2.mlp.experts.w13_input_scale"]
        assert tuple(w13.shape) == (8, 2)
        assert float(w13[5, 1]) == float(stored[f"{L}.2.mlp.experts.5.up_proj.activation_scale"])
        w2 = params["model.layers.2.mlp.experts.w2_input_scale"]
        assert float(w2[3]) == float(stored[f"{L}.2.mlp.experts.3.down_proj.activation_scale"])


def test_compressed_tensors_static_fp8_loads_its_input_scales(ct_static):
    """Block and per tensor: q | k | v and gate | up each their own entry, o / down one."""
    for strategy, folder in ct_static.items():
        stored = load_file(folder / "model.safetensors")
        params = _load(folder, 2, 1)
        qkv = params["model.layers.1.self_attn.qkv_proj.input_scale"]
        want = [stored[f"model.layers.1.self_attn.{x}_proj.input_scale"] for x in "qkv"]
        assert torch.equal(qkv, torch.stack(want).float().reshape(3)), strategy
        down = params["model.layers.0.mlp.down_proj.input_scale"]
        assert float(down) == float(stored["model.layers.0.mlp.down_proj.input_scale"])


def test_static_fp8_passes_shards_and_memory_at_tp_1_and_2(capsys, tmp_path, static,
                                                           ct_static):
    """shards states every stored input scale from the config (none ignored) and memory
    counts its float32 bytes, at TP 1 and 2: Qwen's block FP8 (`activation_scale`) on
    Qwen3.5-MoE, compressed-tensors block and per tensor (`input_scale`) on Llama."""
    folders = {"input_scale": list(ct_static.values()), "activation_scale": [static]}
    models = [str(f) for group in folders.values() for f in group]
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*[a for f in models for a in ("--model", f)], "--tp", "1,2",
              "--checks", "memory,shards", "--report-json", str(report)])
    capsys.readouterr()
    rows = json.loads(report.read_text())["results"]
    assert exit_info.value.code == 0, [r["message"] for r in rows if r["status"] != "pass"]
    assert len(rows) == 4 * len(models) and all(r["status"] == "pass" for r in rows), rows
    # shards passing means its statements agree with the plan, which loads every scale.
    for suffix, group in folders.items():
        for folder in group:
            plan = shard_plan(load_config(folder), 2)
            scales = [n for n in load_file(folder / "model.safetensors")
                      if n.endswith(f".{suffix}")]
            assert scales and all(plan.resolve(n).param.endswith("input_scale")
                                  for n in scales), folder
    for r in rows:
        m = r["metrics"]
        assert r["check"] == "memory" or m["stated"] == m["tensors"] - m["ignored"], m


def _refused(folder, name: str) -> None:
    with pytest.raises(Exception, match=f"{name}: FP8 (block|per-tensor) input scale .* is "
                                        "not finite and above 0"):
        _load(folder)


def test_the_kernels_check_holds_the_input_scales_its_format_stores(capsys, tmp_path, static):
    """The quantized GEMM cases of a static block-FP8 model (linears and routed experts)
    give their layers the stored input scales the format defines, and pass."""
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(static), "--tp", "1", "--checks", "kernels",
              "--report-json", str(report)])
    capsys.readouterr()
    rows = json.loads(report.read_text())["results"]
    assert exit_info.value.code == 0 and [r["status"] for r in rows] == ["pass"], rows


def _shards_failures(folder, tp: int, rank: int) -> list[str]:
    return shards_audit(folder, tp, rank)["failures"]


def test_input_scales_written_into_the_first_entry_fail_shards(monkeypatch, static):
    """An injected plan bug writing every fused destination's input scales into its first
    entry (vLLM #38517 for input scales) fails shards naming k's tensor and both slots."""
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))
    assert not _shards_failures(static, 2, 0), "fails before the bug"

    def first_entry(rule):
        if isinstance(rule.spec, ScalarScale) and rule.pattern.endswith("activation_scale") \
                and rule.slot and not isinstance(rule.slot[0], str):
            return dataclasses.replace(rule, slot=(0,))
        return rule

    rewrite_plans(first_entry)
    failures = _shards_failures(static, 2, 0)
    k = f"{L}.3.self_attn.k_proj.activation_scale"
    assert any(f.startswith(f"{k}: the plan writes it to model.layers.3.self_attn.qkv_proj"
                            ".input_scale[0], the layout says model.layers.3.self_attn"
                            ".qkv_proj.input_scale[1]") for f in failures), failures


@pytest.mark.parametrize("value", [float("nan"), 0.0, -0.5], ids=["nan", "zero", "negative"])
def test_a_bad_input_scale_is_refused_naming_the_tensor(static, tmp_path, value):
    """A NaN, zero or negative stored input scale fails the load naming the tensor; the twin
    refuses it too, naming the module."""
    name = f"{L}.3.self_attn.k_proj.activation_scale"
    bad = with_tensor(static, tmp_path / "bad", name, value)
    _refused(bad, name)
    with pytest.raises(QuantConfigError, match=f"{L}.3.self_attn.k_proj input scale"):
        write_dequantized_twin(bad, tmp_path / "twin", read_quant_config(bad))


def test_a_bad_compressed_tensors_input_scale_is_refused_naming_the_tensor(ct_static,
                                                                         tmp_path):
    for strategy, folder in ct_static.items():
        name = "model.layers.1.mlp.up_proj.input_scale"
        _refused(with_tensor(folder, tmp_path / strategy, name, 0.0), name)


def test_the_twin_drops_the_input_scales(static, tmp_path):
    """The dequantized twin keeps no activation_scale (HF never sees one)."""
    twin = write_dequantized_twin(static, tmp_path / "twin", read_quant_config(static))
    names = load_file(twin / "model.safetensors")
    assert names and not any(n.endswith(".activation_scale") for n in names)
