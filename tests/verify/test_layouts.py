"""Layout statements (`freetoken_verify.checks.shards.layout_book`) give each rank the global rows
the design's model
facts say, written out here by hand for the bundled Qwen3.5 case (8 attention heads of 32, 2
KV heads; GatedDeltaNet 8 key heads of 16, 16 value heads of 12; vocab 301), and the shards
check fails, naming the tensor, when a plan's tensor has no statement or lands elsewhere."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import shards_audit

from freetoken.formats.quant import parse_quant_config
from freetoken_verify.checks.shards.layout_book import LayoutBook
from freetoken_verify.checks.shards.layout_compare import mismatch
from freetoken_verify.checks.shards.layouts import PAD, LayoutError

GOLDEN = Path(__file__).resolve().parents[2] / "freetoken_verify" / "golden"
CASE = GOLDEN / "tiny-qwen3.5-moe"
LAYER = "model.language_model.layers"


def _span(start: int, stop: int) -> list[int]:
    return list(range(start, stop))


def _index(name: str, tp: int, rank: int, dtype=torch.float32) -> list[int]:
    return LayoutBook.from_folder(CASE, tp).state(name, dtype).index(rank, tp).tolist()


def test_conv1d_rank_holds_its_key_heads_of_q_and_k_then_its_value_heads():
    """conv1d rows are [q keys 0..127 | k keys 128..255 | v 256..447]: at TP 2 rank 1 holds
    key heads 4..7 of q and of k, then value heads 8..15 (12 rows each)."""
    got = _index(f"{LAYER}.0.linear_attn.conv1d.weight", 2, 1)
    assert got == _span(64, 128) + _span(192, 256) + _span(352, 448), got


def test_gated_q_proj_rank_holds_q_rows_then_gate_rows_of_its_heads():
    """q_proj rows interleave [q_h | gate_h] per head (64 rows a head): rank 1 of 2 holds the
    q rows of heads 4..7, then their gate rows."""
    got = _index(f"{LAYER}.1.self_attn.q_proj.weight", 2, 1)
    q = [r for h in range(4, 8) for r in _span(h * 64, h * 64 + 32)]
    gate = [r for h in range(4, 8) for r in _span(h * 64 + 32, h * 64 + 64)]
    assert got == q + gate, got


@pytest.mark.parametrize("rank, head", [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_kv_head_replicated_on_rank_r_times_kv_over_tp(rank, head):
    """With 2 KV heads at TP 4, rank r holds KV head r * 2 // 4."""
    assert _index(f"{LAYER}.1.self_attn.v_proj.weight", 4, rank) == _span(head * 32,
                                                                          head * 32 + 32)


def test_vocab_rows_padded_on_the_last_rank():
    """301 rows at TP 4: 76 per rank, rank 3 holds rows 228..300 and 3 padding rows."""
    assert _index("lm_head.weight", 4, 3) == _span(228, 301) + [PAD] * 3


def test_a_log_and_z_by_value_head():
    """A_log: value heads 8..15 on rank 1 of 2; in_proj_z: the same heads' 12 rows each."""
    assert _index(f"{LAYER}.0.linear_attn.A_log", 2, 1) == _span(8, 16)
    assert _index(f"{LAYER}.0.linear_attn.in_proj_z.weight", 2, 1) == _span(96, 192)


def test_nvfp4_down_block_scale_by_16_input_group():
    """down_proj's block scale has one column per 16 inputs (intermediate 128: 8 columns);
    at TP 4 rank 2 holds columns 4, 5 and the packed weight bytes 32..47."""
    book = LayoutBook.from_folder(GOLDEN / "tiny-qwen3.5-moe-nvfp4", 4)
    down = f"{LAYER}.0.mlp.experts.3.down_proj"
    scale = book.state(f"{down}.weight_scale", torch.float8_e4m3fn)
    weight = book.state(f"{down}.weight", torch.uint8)
    assert scale.index(2, 4).tolist() == [4, 5] and scale.dim == 1
    assert weight.index(2, 4).tolist() == _span(32, 48)
    assert scale.param.endswith("experts.w2_weight_scale") and scale.slot == (3,)


def test_heads_that_do_not_divide_name_the_tensor():
    """16 value heads at TP 3: a LayoutError naming the tensor and the count."""
    book = LayoutBook.from_folder(CASE, 3)
    st = book.state(f"{LAYER}.0.linear_attn.A_log", torch.float32)
    with pytest.raises(LayoutError, match=r"A_log: 16 value heads of A_log cannot be split"):
        st.index(0, 3)


def test_plain_chunk_of_conv1d_is_named_row_by_row():
    """A plain row chunk of conv1d at TP 2: rank 0's local row 64 holds q-key row 64 where
    the layout puts k-key row 128."""
    name = f"{LAYER}.0.linear_attn.conv1d.weight"
    st = LayoutBook.from_folder(CASE, 2).state(name, torch.float32)
    full = torch.randn(448, 1, 4)
    assert mismatch(st, full, full[:224].clone(), 0, 2) == (
        "local row 64 holds global row 64 (q keys, key head 4), expected global row 128 "
        "(k keys, key head 0); 160 / 224 rows wrong")
    assert mismatch(st, full, full[_index(name, 2, 0)], 0, 2) is None


def _audit(tp: int, rank: int = 0) -> dict:
    """The shards audit of rank `rank` of `tp` on the case, in this process."""
    return shards_audit(CASE, tp, rank)


def test_a_tensor_the_plan_splits_without_a_statement_fails(monkeypatch):
    """Without a statement for conv1d, the audit names it and the plan's spec."""
    original = LayoutBook.state
    monkeypatch.setattr(LayoutBook, "state", lambda self, name, dtype=None: None
                        if name.endswith("conv1d.weight") else original(self, name, dtype))
    failures = _audit(2)["failures"]
    assert failures and failures[0].startswith(
        f"{LAYER}.0.linear_attn.conv1d.weight: no layout statement covers it (the plan loads "
        "it into model.layers.0.linear_attn.conv1d.weight with Segments"), failures


def test_a_plan_slot_other_than_the_stated_one_fails(monkeypatch):
    """A statement that puts in_proj_b into in_proj_a's rows of the fused in_proj disagrees
    with the plan's slot, and the audit says both."""
    original = LayoutBook.state

    def moved(self, name, dtype=None):
        st = original(self, name, dtype)
        b = name.endswith("in_proj_b.weight")
        return dataclasses.replace(st, slot=(slice(328, 336),)) if b else st

    monkeypatch.setattr(LayoutBook, "state", moved)
    failures = _audit(2)["failures"]
    assert f"{LAYER}.0.linear_attn.in_proj_b.weight: the plan writes it to model.layers.0." \
        "linear_attn.in_proj.weight[320:328], the layout says model.layers.0." \
        "linear_attn.in_proj.weight[328:336]" in failures, failures


def test_bundled_case_audits_clean_in_process():
    """No faults: no failures, and every tensor the engine loads has a statement."""
    summary = _audit(2)
    assert summary["failures"] == [], summary["failures"]
    assert summary["stated"] == summary["tensors"] - summary["ignored"] > 0


# Sizes of the order of a large Qwen3.5-MoE release (not any one checkpoint's exact config).
LARGE = {"model_type": "qwen3_5_moe", "vocab_size": 248320, "tie_word_embeddings": False,
         "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
         "head_dim": 256, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
         "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128}
LARGE_NVFP4_EXPERTS = parse_quant_config({
    "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.language_model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16}}})
LARGE_TENSORS = [
    ("model.language_model.layers.3.self_attn.q_proj.weight", torch.bfloat16, 1),
    ("model.language_model.layers.3.self_attn.k_proj.weight", torch.bfloat16, "kv"),
    ("model.language_model.layers.0.linear_attn.conv1d.weight", torch.bfloat16, 1),
    ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", torch.bfloat16, 1),
    ("model.language_model.layers.0.linear_attn.in_proj_b.weight", torch.bfloat16, 1),
    ("model.language_model.layers.0.linear_attn.out_proj.weight", torch.bfloat16, 1),
    ("model.language_model.layers.0.mlp.shared_expert.up_proj.weight", torch.bfloat16, 1),
    ("model.language_model.layers.0.mlp.experts.511.down_proj.weight", torch.uint8, 1),
    ("model.language_model.layers.0.mlp.experts.511.down_proj.weight_scale",
     torch.float8_e4m3fn, 1),
    ("lm_head.weight", torch.bfloat16, 1),
]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_large_statements_give_every_global_row_to_the_right_number_of_ranks(tp):
    """At large sizes, across all ranks every global row (column) of each stated tensor is
    held exactly once (KV heads: tp / kv times when fewer than ranks), no rank holds a row
    outside the tensor, and only vocab padding is beyond it."""
    book = LayoutBook(LARGE, tp, LARGE_NVFP4_EXPERTS)
    for name, dtype, copies in LARGE_TENSORS:
        st = book.state(name, dtype)
        held = torch.cat([st.index(r, tp) for r in range(tp)])
        rows = held[held != PAD]
        want = max(tp // 2, 1) if copies == "kv" else 1
        counts = torch.bincount(rows, minlength=st.extent)
        assert len(counts) == st.extent and bool((counts == want).all()), (
            f"{name} tp={tp}: rows held {counts.min()}..{counts.max()} times, want {want}")
        pads = int((held == PAD).sum())
        assert pads == (-(-st.extent // tp) * tp - st.extent if st.vocab else 0), name
