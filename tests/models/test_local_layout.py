"""The TP-local layout helpers (`QKVParallelLinear.layout`, `MergedColumnParallelLinear.layout`,
`RowParallelLinear.local_in`, `QGateKVParallelLinear.layout`, `GatedDeltaNet.in_proj_layout`,
`SharedExpert.layout`, `FusedExperts.layout`, `NVFP4FusedExperts.layout`) are what both the
layers and their shard rules size from: for every bundled case at every TP size it supports,
each helper's sizes are the built layer's."""

from __future__ import annotations

import pytest
import torch

from freetoken.distributed import TPInfo, acting_as
from freetoken.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from freetoken.layers.moe import FusedExperts
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.models.qwen3_5_moe.attention import QGateKVParallelLinear
from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet
from freetoken.models.qwen3_5_moe.moe import SharedExpert
from freetoken.models.registry import build_model, check_tp, load_config
from freetoken_verify.cases.catalogue import CASES, bundled_folder

TP_SIZES = (1, 2, 4, 8)


def _supported(cfg, tp: int) -> bool:
    try:
        check_tp(cfg, tp)
    except ValueError:
        return False
    return True


def _column_layouts(cfg, tp: int) -> dict:
    """Engine module name suffix -> the rows its layout helper gives at `tp` ranks."""
    if cfg.arch == "qwen3_5_moe":
        return {"self_attn.qkv_proj": QGateKVParallelLinear.layout(cfg, tp),
                "shared_expert.gate_up_proj": SharedExpert.layout(
                    cfg.shared_expert_intermediate_size, tp)}
    return {"self_attn.qkv_proj": QKVParallelLinear.layout(
                cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, tp),
            "mlp.gate_up_proj": MergedColumnParallelLinear.layout(
                [cfg.intermediate_size] * 2, tp, "intermediate_size")}


def _row_inputs(cfg, tp: int) -> dict:
    """Engine module name suffix -> the input columns `RowParallelLinear.local_in` gives."""
    full = {"self_attn.o_proj": cfg.num_attention_heads * cfg.head_dim,
            "mlp.down_proj": cfg.intermediate_size}
    if cfg.arch == "qwen3_5_moe":
        full.update({"shared_expert.down_proj": cfg.shared_expert_intermediate_size,
                     "linear_attn.out_proj": cfg.linear_num_value_heads
                     * cfg.linear_value_head_dim})
    return {name: RowParallelLinear.local_in(size, tp) for name, size in full.items()}


def _check_linear(name: str, module: LinearBase, local_out: int, local_in: int) -> int:
    assert (module.local_out, module.local_in) == (local_out, local_in), name
    if module.quant is None:
        assert tuple(module.weight.shape) == (local_out, local_in), name
    return 1


def _check_gdn(name: str, module: GatedDeltaNet, cfg, tp: int) -> int:
    rows = GatedDeltaNet.in_proj_layout(cfg, tp)
    assert module.local_sizes == [rows.size("q", "v"), rows.size("z"), rows.size("b"),
                                  rows.size("a")], name
    assert module.conv1d.weight.shape[0] == rows.size("q", "v"), name
    assert module.A_log.shape == module.dt_bias.shape == (rows.size("b"),), name
    if module.in_proj_ba is None:
        return _check_linear(f"{name}.in_proj", module.in_proj, rows.total, cfg.hidden_size)
    ba = rows.select("b", "a")
    return (_check_linear(f"{name}.in_proj", module.in_proj, rows.size("q", "z"),
                          cfg.hidden_size)
            + _check_linear(f"{name}.in_proj_ba", module.in_proj_ba, ba.total, cfg.hidden_size))


def _check_experts(name: str, module, cfg, tp: int) -> int:
    """Stacked experts: w13's gate|up rows and w2's inputs per expert, in any format."""
    helper = NVFP4FusedExperts if isinstance(module, NVFP4FusedExperts) else FusedExperts
    rows = helper.layout(cfg.moe_intermediate_size, tp)
    w13 = module.w13 if isinstance(module, FusedExperts) else module.w13_weight
    assert module.local_intermediate == rows.size("gate") == rows.size("up"), name
    assert w13.shape[:2] == (cfg.num_experts, rows.total), name
    return 1


def _checked_modules(model, cfg, tp: int) -> int:
    """How many of `model`'s parallel modules were checked against their helper."""
    columns, rows, checked = _column_layouts(cfg, tp), _row_inputs(cfg, tp), 0
    for name, module in model.named_modules():
        suffix = ".".join(name.split(".")[-2:])
        if isinstance(module, GatedDeltaNet):
            checked += _check_gdn(name, module, cfg, tp)
        elif isinstance(module, (FusedExperts, BlockFP8FusedExperts, NVFP4FusedExperts)):
            checked += _check_experts(name, module, cfg, tp)
        elif isinstance(module, RowParallelLinear) and suffix in rows:
            checked += _check_linear(name, module, module.local_out, rows[suffix])
        elif isinstance(module, LinearBase) and suffix in columns:
            layout = columns[suffix]
            assert module.local_sizes == list(layout.sizes), name
            checked += _check_linear(name, module, layout.total, cfg.hidden_size)
    return checked


@pytest.mark.parametrize("case", sorted(c for c in CASES if bundled_folder(c) is not None))
def test_layout_helpers_give_the_built_layers_sizes(case):
    """At TP 1, 2, 4 and 8 (those the case splits), every column-parallel layer's rows and
    segments, every row-parallel layer's inputs, GatedDeltaNet's fused in_proj, conv1d and
    per-head parameters, and the stacked experts' rows have the sizes their helper gives."""
    cfg = load_config(bundled_folder(case))
    sizes = [tp for tp in TP_SIZES if _supported(cfg, tp)]
    assert len(sizes) > 1, f"{case}: splits at no TP size above 1"
    for tp in sizes:
        with acting_as(TPInfo(0, tp)), torch.device("meta"):
            model = build_model(cfg)
        assert _checked_modules(model, cfg, tp) >= 2 * cfg.num_hidden_layers, (case, tp)
