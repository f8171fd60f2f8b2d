"""The `kernels` check's quantized-GEMM part: its fixed matrix (every weight-only format on
Qwen3.5's fused attention and GatedDeltaNet in_proj, a row-parallel layer and routed experts,
the last rank of TP 1/2/4/8) and a quantized model's own destinations agree with the float64
format oracle on the engine's CPU path; each wrong GEMM (one fused segment's scale for all, a
divisor global multiplied, a partial block's scale one block early, the next expert's
scales) fails every case of its format that it bites and no other; a layer holding another
rank-local layout than the format's fails naming the parameter; and through the command
line a quantized model's row runs its own GEMMs after the first model's shared matrices."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN
from quant_folders import harness_folders

from freetoken.layers.quantization import Split
from freetoken.layers.quantization.fp8 import block_linear
from freetoken.layers.quantization.fp8 import moe as fp8_moe
from freetoken.layers.quantization.fp8.block_linear import BlockFP8Linear
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken.layers.quantization.fp8.tensor_linear import FP8TensorLinear
from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.models.registry import load_config
from freetoken_verify.checks.kernels import quant
from freetoken_verify.checks.kernels.quant_cases import (
    TP_SIZES,
    fixed_matrix,
    model_matrix,
    with_tokens,
)
from freetoken_verify.checks.quant_layout import blocks_on, held_blocks, rows_on
from freetoken_verify.cli import main
from freetoken_verify.faults import FAULTS

NVFP4_MO, NVFP4_CT = "NVFP4 (modelopt)", "NVFP4 (compressed-tensors)"
FP8_TENSOR, FP8_BLOCK = "FP8 per-tensor (modelopt)", "FP8 block 24x40 (fp8)"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return harness_folders(tmp_path_factory.mktemp("quantized"))


@pytest.fixture()
def restore_quant(monkeypatch):
    """Faults replace methods and module functions; re-setting them through monkeypatch
    first makes pytest put the originals back after the test."""
    for owner, name in ((FP8TensorLinear, "dequantize"), (NVFP4Linear, "dequantize"),
                        (NVFP4FusedExperts, "global_scales"), (block_linear, "dequantize"),
                        (fp8_moe, "dequantize"), (BlockFP8FusedExperts, "dequantize_w13"),
                        (BlockFP8FusedExperts, "dequantize_w2"),
                        (BlockFP8Linear, "scale_shape")):
        monkeypatch.setattr(owner, name, getattr(owner, name))


def _failed(rows) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        if r["failure"]:
            out[r["format"]] = out.get(r["format"], 0) + 1
    return out


def test_layout_arithmetic_follows_the_tp_conventions():
    """KV heads replicated when fewer than ranks, segments starting inside a packed tensor,
    blocks shared by two ranks counted on both and every rank holding the most any needs."""
    kv = Split(32, heads=2)
    assert [rows_on(kv, r, 8) for r in (0, 3, 4, 7)] == [(0, 16)] * 2 + [(16, 16)] * 2
    k = Split(40, start=40, total=160)
    assert rows_on(k, 7, 8) == (75, 5) and blocks_on(k, 7, 8, 24) == (3, 1)
    assert blocks_on(k, 1, 8, 24) == (1, 2), "rows 45..49 straddle blocks 1 and 2"
    assert held_blocks(Split(128), 8, 24) == 2 and held_blocks(Split(128), 1, 24) == 6
    assert held_blocks(Split.whole(112), 8, 40) == 3, "a whole dim: every block on every rank"


def test_real_models_are_bounded_and_unknown_destinations_named():
    """At Qwen3.5-35B-A3B's dimensions a case keeps every rank's GEMM shape but at most 16 of
    the 256 experts and an LM head of 8192 rows (248320 % 8 = 0: no padding at any TP size, as
    the real one); a quantized destination without a layout (the router) is refused by
    name."""
    from freetoken.models.qwen3_5_moe.config import qwen3_5_moe_config
    from freetoken_verify.cases.qwen3_5_moe import REAL_TEXT
    from freetoken_verify.checks.kernels.quant_cases import _bounded
    from freetoken_verify.checks.quant_layout import LayoutError, destination_layout

    cfg = qwen3_5_moe_config({"text_config": dict(REAL_TEXT)})
    experts = _bounded(destination_layout(cfg, "model.layers.0.mlp.experts", 8), cfg, 8)
    assert (experts.experts, experts.top_k, experts.intermediate) == (16, 8, 512), experts
    head = _bounded(destination_layout(cfg, "lm_head", 8), cfg, 8)
    assert head.rows == (Split(8192),) and head.cols == Split.whole(2048), head
    attn = _bounded(destination_layout(cfg, "model.layers.3.self_attn.qkv_proj", 8), cfg, 8)
    assert [rows_on(s, 7, 8)[1] for s in attn.rows] == [512, 512, 256, 256], attn
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.mlp\.gate: no quantized layout"):
        destination_layout(cfg, "model.layers.0.mlp.gate", 1)


def test_fixed_matrix_agrees_with_the_oracle(restore_quant):
    """56 cases: four formats x three layouts and two expert formats at every TP size, each
    within the float32 tolerance of the float64 oracle."""
    cases = fixed_matrix("cpu")
    assert len(cases) == 56 and {c.tp for c in cases} == set(TP_SIZES), len(cases)
    assert all(c.rank == c.tp - 1 for c in cases)
    rows = quant.run_matrix(cases, "cpu", torch.float32)
    assert quant.verdict(rows, "float32") == "", quant.verdict(rows, "float32")
    formats = quant.family_metrics(rows)["quantized"]["formats"]
    assert set(formats) == {NVFP4_MO, NVFP4_CT, FP8_TENSOR, FP8_BLOCK}, formats
    assert max(r["rel_l2"] for r in rows) < 1e-6


@pytest.mark.parametrize("fault, bitten", [
    ("fp8-tensor-first-scale-for-all", {FP8_TENSOR: 8}),
    ("nvfp4-linear-first-global-for-all", {NVFP4_MO: 8, NVFP4_CT: 8}),
    ("nvfp4-divisor-as-multiplier", {NVFP4_CT: 16}),
    ("fp8-block-partial-off-by-one", {FP8_BLOCK: 16}),
    ("fp8-moe-scale-wrong-expert", {FP8_BLOCK: 4}),
])
def test_each_wrong_gemm_fails_its_format(restore_quant, fault, bitten):
    """The fault fails exactly the cases it bites: every fused layout of its format (one
    scale per segment only matters where there are several), or every case of the format
    (the divisor, the partial block), or every expert case; the verdict names a case of the
    format and its mismatch."""
    FAULTS[fault]()
    rows = quant.run_matrix(fixed_matrix("cpu"), "cpu", torch.float32)
    assert _failed(rows) == bitten, _failed(rows)
    verdict = quant.verdict(rows, "float32")
    first = next(iter(bitten))
    assert verdict.startswith(f"quantized GEMMs in float32: {sum(bitten.values())} / 56 "
                              "cases fail against the format oracle"), verdict
    assert f"first: {first} " in verdict and "mismatched" in verdict, verdict


def test_a_layer_holding_another_layout_fails_naming_the_parameter(restore_quant):
    """A block-FP8 linear allocating one scale row too many per rank (a layout other than
    the format's) fails each block-FP8 linear case naming `weight_scale` and both shapes
    (q | gate | k | v at TP 8: 16 + 16 per-row q and gate rows, 2 + 2 blocks of k and v)."""
    original = BlockFP8Linear.scale_shape
    BlockFP8Linear.scale_shape = lambda self: (original(self)[0] + 1, original(self)[1])
    cases = [c for c in fixed_matrix("cpu") if c.fmt.kind == "fp8-block" and c.tp == 8]
    rows = quant.run_matrix(cases, "cpu", torch.float32)
    linear = [r for r in rows if "routed experts" not in r["case"]]
    assert len(linear) == 3 and all(r["failure"] for r in linear), rows
    assert "LayoutMismatch: weight_scale: the layer holds [37, 3] float32, the format's " \
           "rank-local layout is [36, 3] bfloat16" in linear[0]["failure"], linear[0]


def test_model_cases_cover_every_quantized_destination(folders):
    """A quantized model's cases: one per destination kind and format at each TP size it
    runs, every one agreeing with the oracle; an unquantized model has none."""
    want = {
        "block-fp8": {"qkv_proj (q | gate | k | v)", "o_proj",
                      "GatedDeltaNet in_proj (q | k | v | z)", "GatedDeltaNet out_proj",
                      "shared_expert.gate_up_proj (gate | up)", "shared_expert.down_proj",
                      "routed experts"},
        "modelopt-mixed": {"lm_head", "qkv_proj (q | gate | k | v)", "o_proj",
                           "GatedDeltaNet in_proj (q | k | v | z)", "GatedDeltaNet out_proj",
                           "shared_expert.gate_up_proj (gate | up)", "shared_expert.down_proj",
                           "routed experts"},
        "ct-nvfp4": {"qkv_proj (q | gate | k | v)", "o_proj", "routed experts"},
        "modelopt-fp8-dense": {"qkv_proj (q | k | v)", "o_proj", "gate_up_proj (gate | up)",
                               "down_proj"},
    }
    for name, labels in want.items():
        cases = model_matrix(load_config(folders[name]), name)
        got = {getattr(c.layout, "label", "routed experts") for c in cases}
        assert got == labels, (name, got)
        assert {c.tp for c in cases} == set(TP_SIZES), name
        rows = quant.run_matrix(with_tokens(cases, "cpu"), "cpu", torch.float32)
        assert quant.verdict(rows, "float32") == "", (name, quant.verdict(rows, "float32"))
    assert model_matrix(load_config(GOLDEN / "tiny-llama"), "tiny-llama") == []


def test_quantized_model_rows_run_their_own_gemms(capsys, tmp_path, folders):
    """`--model <block FP8> --model <ModelOpt mixed> --tp 1 --checks kernels` with a partial
    block read one block early: the first row runs every matrix and fails naming a block-FP8
    case (the NVFP4 and engine kernels still agree with their references); the second row,
    a quantized model after the first, runs only its own GEMMs, which have no block FP8,
    and passes."""
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--checks", "kernels", "--tp", "1", "--model", str(folders["block-fp8"]),
              "--model", str(folders["modelopt-mixed"]), "--inject",
              "fp8-block-partial-off-by-one", "--report-json", str(report)])
    capsys.readouterr()
    first, second = json.loads(report.read_text())["results"]
    assert exit_info.value.code == 1 and first["status"] == "fail", first
    message = first["message"]
    assert message.startswith(f"{folders['block-fp8']} tp=1: quantized GEMMs in float32: "), \
        message
    assert f"first: {FP8_BLOCK} " in message and "engine kernels" not in message, message
    families = first["metrics"]["families"]
    assert families["quantized"]["cases"] == 56 + 28, families["quantized"]
    assert families["nvfp4"]["failed_cases"] == 0 and families["paged_attention"]["cases"] > 0
    assert second["status"] == "pass", second
    assert set(second["metrics"]["families"]) == {"quantized"}, second["metrics"]
    assert second["metrics"]["families"]["quantized"]["cases"] == 32
