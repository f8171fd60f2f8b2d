"""Qwen3.5-MoE in block FP8 (Qwen's FP8 releases: attention, GDN in_proj_qkv / in_proj_z /
out_proj, shared expert and routed experts quantized; routers, in_proj_b / in_proj_a,
embeddings and lm_head kept), weight-only, end to end on CPU in fp32.

The checkpoint is the bundled case quantized with 24 x 40 blocks: q_proj's heads of 32 rows
cut through blocks (its scale is expanded per row at load), in_proj_qkv's k segment starts
mid-block (128 = 5 x 24 + 8), and at TP 8 the shared expert's 6 rows, the experts' 4 rows
and down's 4 inputs per rank share blocks. The reference is the dequantized twin at TP 1
(observed max abs 0.0 at TP 1, 2e-6 at TP 2 and 8: reduction order)."""

from __future__ import annotations

from pathlib import Path

from conftest import GOLDEN
from twin_outputs import assert_round_trips, assert_same_outputs, generate

from freetoken.formats.fp8.convert import write_block_fp8
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.models.registry import load_config

BLOCK = (24, 40)
NOT_CONVERT = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_b",
               "in_proj_a")


def _make_pair(tmp_path: Path) -> tuple[Path, Path]:
    fp8 = write_block_fp8(GOLDEN / "tiny-qwen3.5-moe", tmp_path / "fp8", BLOCK, NOT_CONVERT)
    return fp8, write_dequantized_twin(fp8, tmp_path / "twin", read_quant_config(fp8))


def test_modules_resolve_to_qwens_fp8_layout(tmp_path):
    """Every projection Qwen quantizes is block FP8; GDN in_proj is two GEMMs, [qkv | z] in
    FP8 and [b | a] unquantized; routers, shared-expert gates and lm_head stay bf16."""
    cfg = load_config(_make_pair(tmp_path)[0])
    gemms = cfg.module_formats
    in_proj = [(len(g.parts), g.format.kind) for g in gemms["model.layers.0.linear_attn.in_proj"]]
    assert in_proj == [(2, "fp8-block"), (2, "bf16")], in_proj
    for name in ("model.layers.1.self_attn.qkv_proj", "model.layers.0.linear_attn.out_proj",
                 "model.layers.0.mlp.shared_expert.down_proj", "model.layers.3.mlp.experts"):
        assert gemms[name][0].format.kind == "fp8-block", (name, gemms[name])
    for name in ("lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"):
        assert gemms[name][0].format.kind == "bf16", (name, gemms[name])
    assert not cfg.nvfp4_experts


def test_engine_matches_the_dequantized_twin_at_every_tp(tmp_path):
    """At TP 1, 2, 4 and 8 the block-FP8 checkpoint gives the twin's prompt and decode
    logits to float32 tolerance and the same greedy tokens."""
    fp8, twin = _make_pair(tmp_path)
    want = generate(twin, 1)
    for tp in (1, 2, 4, 8):
        assert_same_outputs(generate(fp8, tp), want, f"tp={tp}")


def test_shards_of_every_tensor_round_trip_bitwise(tmp_path):
    """At TP 1/2/4/8 every tensor (fp8 weights, bf16 block scales: q_proj's expanded per row,
    in_proj_qkv's per segment, experts' shared blocks) shards and unshards bitwise through
    its rule, and the loader's pieces write the same bytes as shard()."""
    fp8, _ = _make_pair(tmp_path)
    assert_round_trips(fp8)
