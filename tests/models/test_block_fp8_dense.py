"""Block FP8 (Qwen's FP8 layout: `weight` e4m3, bf16 `weight_scale_inv` per block, HF
`quant_method: fp8`) on Llama, Qwen3 and Qwen3-MoE (routed experts included, as in
Qwen3-30B-A3B-FP8), weight-only, end to end on CPU in fp32.

The checkpoints are the bundled cases quantized with 24 x 40 blocks, so that every dimension
ends in a partial block (64 = 40 + 24 inputs, 128 = 5 x 24 + 8 rows) and at TP 8 each rank's
16 rows or inputs share a block with a neighbour (q, gate, up, o and down inputs; KV heads
of 16 rows start mid-block). The reference is the same model with every weight dequantized
in float64 from the format definition (the dequantized twin); an e4m3 code times a bf16
scale is exact in float32, so the only error is TP reduction order (observed: 0.0 at TP 1
and 8 on tiny-llama)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GOLDEN
from safetensors.torch import load_file, save_file
from twin_outputs import assert_round_trips, assert_same_outputs, generate

from freetoken.formats.fp8.convert import write_block_fp8
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.loading.loader import LoadError
from freetoken.models.registry import check_tp, load_config

BLOCK = (24, 40)
NOT_CONVERT = ("lm_head", "model.embed_tokens")
ROUTERS = ("mlp.gate",)


def _make_pair(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """(block-FP8 checkpoint of `case`, its dequantized twin)."""
    keep = NOT_CONVERT + (ROUTERS if "moe" in case else ())
    fp8 = write_block_fp8(GOLDEN / case, tmp_path / f"{case}-fp8", BLOCK, keep)
    return fp8, write_dequantized_twin(fp8, tmp_path / f"{case}-twin", read_quant_config(fp8))


@pytest.mark.parametrize("case,tp_sizes", [("tiny-llama", (1, 2, 4, 8)),
                                           ("tiny-qwen3", (1, 8)),
                                           ("tiny-qwen3-moe", (1, 2, 4, 8))])
def test_engine_matches_the_dequantized_twin(tmp_path, case, tp_sizes):
    """The block-FP8 checkpoint at every TP size gives the twin's TP 1 prompt and decode
    logits to float32 tolerance and the same greedy tokens: every segment (q, k, v, gate,
    up) reads its own scale rows, shared and partial blocks dequantize exactly."""
    fp8, twin = _make_pair(tmp_path, case)
    cfg = load_config(fp8)
    kinds = {g.format.kind for gemms in cfg.module_formats.values() for g in gemms}
    assert kinds == {"bf16", "fp8-block"}, kinds
    want = generate(twin, 1)
    for tp in tp_sizes:
        assert_same_outputs(generate(fp8, tp), want, f"{case} tp={tp}")


def test_shards_of_every_tensor_round_trip_bitwise(tmp_path):
    """At TP 1/2/4/8 every tensor of the block-FP8 checkpoint (fp8 weights, bf16 scales)
    shards and unshards bitwise through its plan rule, and the loader's pieces write the
    same bytes as shard()."""
    fp8, _ = _make_pair(tmp_path, "tiny-llama")
    assert_round_trips(fp8)


def test_a_weight_not_in_its_declared_format_is_refused(tmp_path):
    """A block-FP8 checkpoint whose config declares q_proj FP8 but stores it in float32 is
    refused by the loader naming the tensor (a cast to e4m3 would load garbage)."""
    fp8, twin = _make_pair(tmp_path, "tiny-llama")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = load_file(fp8 / "model.safetensors")
    tensors[name] = load_file(twin / "model.safetensors")[name]
    save_file(tensors, fp8 / "model.safetensors")
    with pytest.raises(LoadError, match=rf"'{name}' is torch.float32, but the quantization "
                                        r"config makes parameter .* torch.float8_e4m3fn"):
        generate(fp8, 1)


def test_experts_in_different_formats_per_layer_are_refused(tmp_path):
    """A Qwen3-MoE config leaving one MoE layer's experts unquantized (modules_to_not_convert
    naming layer 2's experts; layer 1 is dense) is refused by the TP check, before any rank
    starts, naming both layers and formats; naming layer 1's experts, which do not exist,
    is refused naming the entry."""
    keep = NOT_CONVERT + ROUTERS + ("model.layers.2.mlp.experts",)
    fp8 = write_block_fp8(GOLDEN / "tiny-qwen3-moe", tmp_path / "mixed", BLOCK, keep)
    with pytest.raises(ValueError, match=r"routed experts of layer 0 are FP8 block 24x40 "
                                         r"\(fp8\) but layer 2's unquantized"):
        check_tp(load_config(fp8), 1)
    keep = NOT_CONVERT + ROUTERS + ("model.layers.1.mlp.experts",)
    fp8 = write_block_fp8(GOLDEN / "tiny-qwen3-moe", tmp_path / "dense", BLOCK, keep)
    with pytest.raises(ValueError, match=r"modules_to_not_convert names "
                                         r"'model.layers.1.mlp.experts', which is none"):
        load_config(fp8)
