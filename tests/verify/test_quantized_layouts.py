"""Layout statements of quantized tensors (`freetoken_verify.checks.shards.linears`), written
out here by hand from the config and the format definitions: block-FP8 scale rows and columns
(24 x 40 blocks on the bundled Qwen3.5 case: ranks sharing a block both hold it, the last
block partial, in_proj_qkv's k segment starting mid-block, q_proj's scale one row per weight
row), per-tensor FP8 and NVFP4 global scales one entry per fused segment, NVFP4 packed bytes
and block scales on 16-input groups, an NVFP4 lm_head's padded vocab rows; at Qwen3.5-35B-A3B
dimensions in 128 x 128 blocks at TP 8, the experts' 64 rows per rank two ranks to a block. A
tensor whose dtype does not fit its module's declared format is refused naming it."""

from __future__ import annotations

import pytest
import torch
from conftest import GOLDEN
from quant_folders import block_fp8_config, modelopt_mixed_config, redhat_config

from freetoken.formats.quant import parse_quant_config
from freetoken_verify.checks.shards.layout_book import LayoutBook, read_text_config
from freetoken_verify.checks.shards.layouts import PAD, LayoutError

L = "model.language_model.layers"
TINY = read_text_config(GOLDEN / "tiny-qwen3.5-moe")
NVFP4_TINY = {**read_text_config(GOLDEN / "tiny-qwen3.5-moe-nvfp4"),
              "shared_expert_intermediate_size": 128}


def _book(tp: int, quant: dict | None, config: dict = TINY) -> LayoutBook:
    return LayoutBook(config, tp, parse_quant_config(quant, "quantization_config"))


def _index(book: LayoutBook, name: str, rank: int) -> list[int]:
    return book.state(name).index(rank, book.tp).tolist()


def _blocks(rows, block: int) -> list[int]:
    return [r // block for r in rows]


def test_expert_block_scale_rows_shared_by_ranks_and_padded():
    """moe_intermediate 32 in 24-row blocks: at TP 2 rank 0's rows 0..15 touch block 0 and
    rank 1's rows 16..31 blocks 0 and 1, so both hold 2 entries (rank 0 a zero pad) and up's
    start after gate's; at TP 8 ranks 0..5 hold block 0, ranks 6 and 7 the partial block 1.
    down's 32 inputs are one partial 40-column block, held by every rank."""
    book = _book(2, block_fp8_config())
    gate = book.state(f"{L}.0.mlp.experts.5.gate_proj.weight_scale_inv")
    up = book.state(f"{L}.0.mlp.experts.5.up_proj.weight_scale_inv")
    assert [gate.index(r, 2).tolist() for r in (0, 1)] == [[0, PAD], [0, 1]]
    assert (gate.param, gate.slot, up.slot) == ("model.layers.0.mlp.experts.w13_weight_scale",
                                                (5, slice(0, 2)), (5, slice(2, 4)))
    book = _book(8, block_fp8_config())
    name = f"{L}.0.mlp.experts.5.gate_proj.weight_scale_inv"
    assert [_index(book, name, r) for r in range(8)] == [[0]] * 6 + [[1]] * 2
    down = book.state(f"{L}.0.mlp.experts.5.down_proj.weight_scale_inv")
    assert down.dim == 1 and down.shapes == ((3, 1),)
    assert [down.index(r, 8).tolist() for r in range(8)] == [[0]] * 8


def test_gdn_qkv_scale_blocks_per_segment_with_the_k_segment_starting_mid_block():
    """in_proj_qkv rows [q keys 0..127 | k keys 128..255 | v 256..447] in 24-row blocks:
    block 5 holds q's last rows and k's first, block 10 k's last and v's first, so at TP 1
    each appears once per segment; at TP 2 each segment's blocks are split on their own
    (padded to the most a rank touches), then in_proj_z's blocks follow in the scale rows."""
    one = _book(1, block_fp8_config())
    qkv = f"{L}.0.linear_attn.in_proj_qkv.weight_scale_inv"
    assert _index(one, qkv, 0) == [*range(0, 6), *range(5, 11), *range(10, 19)]
    assert one.state(qkv).describe(5) == "rows 120..143: q keys, key head 7 to k keys, key head 0"
    two = _book(2, block_fp8_config())
    assert _index(two, qkv, 0) == [0, 1, 2, PAD, 5, 6, 7, 10, 11, 12, 13, 14]
    assert _index(two, qkv, 1) == [2, 3, 4, 5, 8, 9, 10, 14, 15, 16, 17, 18]
    z = two.state(f"{L}.0.linear_attn.in_proj_z.weight_scale_inv")
    assert z.slot == (slice(12, 16),) and z.index(1, 2).tolist() == [4, 5, 6, 7]


def test_q_gate_scale_expanded_per_row_moves_with_its_head():
    """q_proj rows interleave [q_h | gate_h] (64 rows a head); 24-row blocks cut through
    heads, so rank r holds one scale row per weight row, in the weight's regrouped order:
    at TP 2 rank 1 the q rows of heads 4..7, then their gate rows, each row's block; k's
    blocks follow (KV head r * 2 // 4 at TP 4, rows 0..31 or 32..63)."""
    book = _book(2, block_fp8_config())
    st = book.state(f"{L}.3.self_attn.q_proj.weight_scale_inv")
    q = [h * 64 + i for h in range(4, 8) for i in range(32)]
    gate = [h * 64 + 32 + i for h in range(4, 8) for i in range(32)]
    assert st.per_row and st.index(1, 2).tolist() == _blocks(q + gate, 24)
    assert st.slot == (slice(0, 256),) and st.shapes == ((22, 2),)
    four = _book(4, block_fp8_config())
    k = four.state(f"{L}.3.self_attn.k_proj.weight_scale_inv")
    assert k.slot == (slice(128, 130),)
    assert [k.index(r, 4).tolist() for r in range(4)] == [[0, 1], [0, 1], [1, 2], [1, 2]]


def test_per_tensor_and_global_scales_one_entry_per_segment():
    """ModelOpt mixed: each FP8 tensor's 0-d weight_scale and input_scale go whole into its
    own entry of the destination's (q 0, k 1, v 2; in_proj_qkv 0, in_proj_z 1); NVFP4 gate
    and up globals into entries 0 and 1, an expert's into [e, 0 | 1] and [e]; in_proj_b / a
    (bf16) into in_proj_ba. Compressed-tensors: the divisor globals the same way, NVFP4
    input scales not loaded."""
    mixed = _book(2, modelopt_mixed_config(), NVFP4_TINY)
    expect = {
        f"{L}.3.self_attn.k_proj.weight_scale": ("model.layers.3.self_attn.qkv_proj"
                                                  ".weight_scale", (1,)),
        f"{L}.3.self_attn.v_proj.input_scale": ("model.layers.3.self_attn.qkv_proj"
                                                 ".input_scale", (2,)),
        f"{L}.0.linear_attn.in_proj_z.weight_scale": ("model.layers.0.linear_attn.in_proj"
                                                       ".weight_scale", (1,)),
        f"{L}.0.mlp.shared_expert.up_proj.weight_scale_2": (
            "model.layers.0.mlp.shared_expert.gate_up_proj.weight_scale_2", (1,)),
        f"{L}.0.mlp.experts.3.up_proj.weight_scale_2": ("model.layers.0.mlp.experts"
                                                        ".w13_weight_scale_2", (3, 1)),
        f"{L}.0.mlp.experts.3.down_proj.weight_scale_2": ("model.layers.0.mlp.experts"
                                                          ".w2_weight_scale_2", (3,)),
        "lm_head.weight_scale_2": ("lm_head.weight_scale_2", (0,)),
        f"{L}.0.linear_attn.in_proj_a.weight": ("model.layers.0.linear_attn.in_proj_ba.weight",
                                                (slice(8, 16),)),
    }
    for name, destination in expect.items():
        st = mixed.state(name)
        assert (st.param, st.slot) == destination, name
    ct = _book(2, redhat_config(), NVFP4_TINY)
    v = ct.state(f"{L}.3.self_attn.v_proj.weight_global_scale")
    assert (v.param, v.slot, v.replicated) == ("model.layers.3.self_attn.qkv_proj"
                                               ".weight_scale_2", (2,), True)
    assert ct.state(f"{L}.3.self_attn.v_proj.input_global_scale").ignored


def test_compressed_tensors_fp8_names_its_block_and_tensor_scales_weight_scale():
    """compressed-tensors FP8 names its scale `weight_scale` for both strategies: with
    `block` a block grid (k_proj's 24-row blocks after q's 128 per-row scale rows at TP 4),
    with `tensor` a 0-d scale into k's entry, its input scale not loaded."""
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [24, 40]}
    block = {"quant_method": "compressed-tensors", "ignore": ["re:.*in_proj_[ab]$"],
             "config_groups": {"g": {"targets": ["re:.*self_attn.*"], "weights": weights}}}
    k = _book(4, block).state(f"{L}.3.self_attn.k_proj.weight_scale", torch.bfloat16)
    assert (k.block, k.slot, k.shapes) == (24, (slice(128, 130),), ((3, 2),))
    tensor = {**block, "config_groups": {"g": {"targets": ["re:.*self_attn.*"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}}}}
    book = _book(4, tensor)
    k = book.state(f"{L}.3.self_attn.k_proj.weight_scale", torch.float32)
    assert (k.param, k.slot, k.replicated) == ("model.layers.3.self_attn.qkv_proj.weight_scale",
                                               (1,), True)
    assert book.state(f"{L}.3.self_attn.k_proj.input_scale").ignored


def test_nvfp4_inputs_by_16_groups_and_lm_head_vocab_rows_padded():
    """NVFP4 o_proj (256 inputs, 16 groups): at TP 4 rank 1 holds groups 4..7, packed bytes
    32..63 and scale columns 4..7; the shared expert's up rows after gate's (64 each at TP
    2); an NVFP4 lm_head's block scale by vocab row, 301 rows padded to 151 per rank."""
    ct = _book(4, redhat_config(), NVFP4_TINY)
    packed = ct.state(f"{L}.3.self_attn.o_proj.weight_packed")
    scale = ct.state(f"{L}.3.self_attn.o_proj.weight_scale")
    assert packed.index(1, 4).tolist() == list(range(32, 64)) and packed.dim == 1
    assert scale.index(1, 4).tolist() == [4, 5, 6, 7] and scale.shapes == ((64, 16),)
    mixed = _book(2, modelopt_mixed_config(), NVFP4_TINY)
    up = mixed.state(f"{L}.1.mlp.shared_expert.up_proj.weight")
    assert up.slot == (slice(64, 128),) and up.shapes == ((128, 32),)
    head = mixed.state("lm_head.weight_scale")
    assert head.param == "lm_head.weight_scale" and head.shapes == ((301, 4),)
    assert head.index(1, 2).tolist() == [*range(151, 301), PAD]


REAL = {"model_type": "qwen3_5_moe", "vocab_size": 248320, "tie_word_embeddings": False,
        "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128}
"""Qwen3.5-35B-A3B's text dimensions (the formats sheet of the project's issue 26)."""


def test_real_dimensions_block_fp8_at_tp8_two_ranks_to_a_block():
    """128 x 128 blocks at TP 8: each rank's 64 expert rows (inputs) are half a block, so
    rank r holds block r // 2 and every block is held by exactly two ranks; q_proj (two heads
    of [q 256 | gate 256] a rank) one scale row per weight row; o_proj's 512 inputs a rank
    4 whole blocks; in_proj_qkv 2 + 2 + 4 blocks per rank."""
    book = _book(8, block_fp8_config((128, 128)), REAL)
    for x in ("gate", "down"):
        name = f"{L}.0.mlp.experts.255.{x}_proj.weight_scale_inv"
        held = [_index(book, name, r) for r in range(8)]
        assert held == [[r // 2] for r in range(8)], (x, held)
    q = book.state(f"{L}.3.self_attn.q_proj.weight_scale_inv")
    rows = [h * 512 + i for part in (0, 256) for h in (0, 1) for i in range(part, part + 256)]
    assert q.index(0, 8).tolist() == _blocks(rows, 128) and q.shapes == ((64, 16),)
    assert _index(book, f"{L}.3.self_attn.o_proj.weight_scale_inv", 3) == [12, 13, 14, 15]
    assert _index(book, f"{L}.0.linear_attn.in_proj_qkv.weight_scale_inv", 1) == [
        2, 3, 18, 19, 36, 37, 38, 39]


@pytest.mark.parametrize("name, dtype, quant, words", [
    (f"{L}.3.self_attn.q_proj.weight", torch.float8_e4m3fn, None,
     rf"{L}\.3\.self_attn\.q_proj\.weight is float8_e4m3fn, but with no quantization config "
     r"its module is bf16 \(unquantized\), which stores weight as an unquantized float"),
    (f"{L}.0.linear_attn.in_proj_b.weight", torch.float8_e4m3fn, block_fp8_config(),
     r"in_proj_b\.weight is float8_e4m3fn, but quantization_config makes its module bf16"),
    (f"{L}.3.self_attn.q_proj.weight", torch.bfloat16, block_fp8_config(),
     r"q_proj\.weight is bfloat16, but quantization_config makes its module FP8 block 24x40 "
     r"\(fp8\), which stores weight as float8_e4m3fn"),
    (f"{L}.3.self_attn.q_proj.weight_scale", torch.float32, redhat_config(),
     r"stores weight_scale as float8_e4m3fn"),
    (f"{L}.3.self_attn.q_proj.weight_scale_inv", torch.float32, None,
     r"its module is bf16 \(unquantized\), whose tensors are weight; 'weight_scale_inv' is "
     "none of them"),
    (f"{L}.0.linear_attn.norm.weight", torch.float8_e4m3fn, block_fp8_config(),
     r"norm\.weight is float8_e4m3fn, quantized data, in a module no quantized format covers"),
])
def test_a_dtype_its_declared_format_does_not_store_is_refused(name, dtype, quant, words):
    """The format comes from the config: quantized data in a bf16 module, a bf16 weight in an
    FP8 module, a float32 NVFP4 block scale, a scale tensor of an unquantized module and a
    float8 norm each fail naming the tensor, what it is and what the format stores."""
    with pytest.raises(LayoutError, match=words):
        _book(2, quant, NVFP4_TINY if quant is not None and "ignore" in quant else TINY
              ).state(name, dtype)


def test_formats_come_from_the_config_not_the_dtype():
    """The same float8 weight is block FP8 under Qwen's config (its scale stated, whole
    columns) and refused without one: no statement is guessed from a dtype."""
    name = f"{L}.0.linear_attn.out_proj.weight"
    st = _book(2, block_fp8_config()).state(name, torch.float8_e4m3fn)
    assert st.shapes == ((64, 192),) and st.dim == 1
    with pytest.raises(LayoutError, match="no quantization config"):
        _book(2, None).state(name, torch.float8_e4m3fn)
