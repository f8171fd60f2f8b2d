"""The bisect check's pieces: TP layouts rebuild full activations exactly, the per-module
table finds the first divergence (ranks disagreeing, values or shapes off), HF's modules map
onto the engine's fused ones, and the low-precision excuse in golden needs every module clean."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import record_modules

from freetoken.config import EngineConfig
from freetoken.engine.core import EngineCore
from freetoken.models.registry import load_config
from freetoken_verify.activations.engine import FULL, PARTIAL, flat, unshard
from freetoken_verify.activations.hf import NameMap
from freetoken_verify.cases.catalogue import GOLDEN
from freetoken_verify.checks.bisect.check import Bisection, Row, row_distance


def _make_parts(full: torch.Tensor, segments, tp: int) -> list[torch.Tensor]:
    """Shard `full` [tokens, features] the way `segments` states, independently of unshard."""
    parts = [[] for _ in range(tp)]
    offset = 0
    for kind, size, unit in segments:
        seg = full[:, offset : offset + size]
        heads = size // unit
        for r in range(tp):
            if kind == "kv" and heads < tp:
                h = r * heads // tp
                parts[r].append(seg[:, h * unit : (h + 1) * unit])
            else:
                step = size // tp
                parts[r].append(seg[:, r * step : (r + 1) * step])
        offset += size
    return [torch.cat(p, dim=1) for p in parts]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_unshard_inverts_the_stated_layout(tp):
    """Segments split by rank and KV heads replicated past their count come back whole."""
    segments = (("split", 64, 1), ("kv", 2 * 16, 16), ("kv", 2 * 16, 16), ("split", 8, 1))
    full = torch.randn(5, 64 + 32 + 32 + 8)
    parts = _make_parts(full, segments, tp)
    assert torch.equal(unshard(("segments", segments), parts), full)


def test_unshard_of_a_plain_concatenation_is_not_the_layout():
    """Concatenating ranks' parts in rank order is wrong for packed [q | k | v]: the layout
    matters (a bug that splits plainly must not look right)."""
    segments = (("split", 8, 1), ("split", 8, 1))
    full = torch.arange(16.0).repeat(3, 1)
    parts = _make_parts(full, segments, 2)
    assert not torch.equal(torch.cat(parts, dim=1), full)
    assert torch.equal(unshard(("segments", segments), parts), full)


def test_partial_sums_add_and_full_takes_rank_zero():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.allclose(unshard(PARTIAL, [a, b]), a + b)
    assert torch.equal(unshard(FULL, [a, b]), a)


def test_flat_rows_are_tokens():
    """A one-token decode keeps one row, whatever its head dims; a [1, T, C] batch drops the
    batch dim; an LM head on the last token keeps its single row."""
    assert flat(torch.randn(1, 4, 16), tokens=1).shape == (1, 64)
    assert flat(torch.randn(1, 7, 12), tokens=7).shape == (7, 12)
    assert flat(torch.randn(1, 301), tokens=23).shape == (1, 301)


def _make_bisection(*rows: Row) -> Bisection:
    return Bisection(list(rows), ("TP=1",))


def test_first_divergence_names_the_module_and_how_clean_before():
    found = _make_bisection(Row("prefill/a", vs_tp1=1e-7), Row("prefill/b", vs_tp1=0.9),
                            Row("prefill/c", vs_tp1=1.2))
    assert found.first.module == "prefill/b"
    message = found.message()
    assert message.startswith("first divergence: prefill/b (rel L2 0.9 vs TP=1")
    assert "earlier modules <= 1.0e-07" in message


def test_rank_disagreement_and_shape_are_divergences():
    assert "rank 1 holds a different replicated tensor" in _make_bisection(
        Row("prefill/x", vs_tp1=0.0, ranks_disagree=1)).message()
    assert "shape (1, 302) where TP=1 has (1, 301)" in _make_bisection(
        Row("prefill/lm_head", shape_vs_tp1=((1, 302), (1, 301)))).message()
    assert _make_bisection(Row("prefill/x", vs_tp1=5e-4)).first is None


def test_non_finite_output_is_named_as_the_first_divergence():
    """A module whose output holds NaN or Inf diverges with an infinite error, and the row
    says NaN/Inf where the values came from."""
    assert math.isinf(row_distance(torch.tensor([float("nan"), 1.0]), torch.ones(2)))
    assert row_distance(torch.ones(3), torch.ones(3)) == 0.0
    found = _make_bisection(Row("prefill/a", vs_tp1=0.0),
                            Row("prefill/model.layers.1.mlp", vs_tp1=math.inf))
    assert found.message().startswith(
        "first divergence: prefill/model.layers.1.mlp (rel L2 NaN/Inf vs TP=1")


def test_hf_names_map_fused_modules_and_regroup_q_gate():
    """qkv_proj is HF's q, k, v concatenated; a gated q_proj's per-head [q_h | gate_h] rows
    become [all q | all gates]; the multimodal prefix is added."""
    acts = {"model.language_model.layers.0.self_attn.q_proj":
            torch.tensor([[0.0, 1, 10, 11, 2, 3, 12, 13]]),
            "model.language_model.layers.0.self_attn.k_proj": torch.tensor([[20.0, 21]]),
            "model.language_model.layers.0.self_attn.v_proj": torch.tensor([[30.0, 31]])}
    names = NameMap({"model.language_model"}, num_heads=2, head_dim=2)
    got = names.lookup(acts, "model.layers.0.self_attn.qkv_proj", tokens=1)
    assert got.tolist() == [[0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 30, 31]]
    assert names.lookup(acts, "model.layers.0.mlp.gate_up_proj", tokens=1) is None


def _run_golden(model: str, tp: tuple[int, ...], dtype: str, faults: tuple[str, ...] = ()):
    from freetoken_verify.cases.catalogue import resolve_case
    from freetoken_verify.checks import VerifyOptions, available_checks
    from freetoken_verify.running.runner import Plan, run_plan

    plan = Plan([resolve_case(model)], list(tp), {"golden": available_checks()["golden"]},
                VerifyOptions(device="cpu", dtype=dtype, timeout=240.0), faults)
    return run_plan(plan, progress=lambda line: None)


def test_low_precision_excess_with_every_module_clean_passes(monkeypatch):
    """In bf16, logits beyond a (here artificially tight) bound pass when bisect finds every
    module within HF's own error at that module, and say so in the JSON message; the same
    tight bound with a real TP bug still fails, naming the module."""
    from dataclasses import replace

    from freetoken_verify import compare
    from freetoken_verify.compare import logits

    tight = replace(compare.TOLERANCES[torch.bfloat16], max_rel_l2=1e-6, max_kl=1e-9)
    monkeypatch.setattr(logits, "effective_tolerance", lambda dtype, baseline=None: tight)
    clean = _run_golden("tiny-qwen3", (1,), "bfloat16")[0]
    assert clean.status == "pass", clean.message
    assert clean.metrics.get("judged_per_module") == 1 and "near-ties" in clean.message
    buggy = _run_golden("tiny-llama", (2,), "bfloat16", ("row-bias-before-allreduce",))[0]
    assert buggy.status == "fail" and "self_attn.o_proj" in buggy.message, buggy.message


def test_hf_decode_rows_are_left_out_when_hf_consumed_another_token():
    """Saved HF activations hold HF's own decode step: where the engine decoded another token,
    only the prefill rows are compared with HF (a decode row differing from HF is then no
    divergence), and with the same token both are."""
    from types import SimpleNamespace

    from freetoken_verify.checks.bisect.check import _rows

    cfg = SimpleNamespace(quantization=None)
    ctx = SimpleNamespace(options=SimpleNamespace(dtype="float32", bitwise=False),
                          case=SimpleNamespace(model_config=cfg))
    hf_out = torch.arange(12.0).reshape(3, 4) + 1  # 2 prompt rows + 1 decode row
    names = NameMap({"model"}, num_heads=1, head_dim=4)
    hf = (names, {"model.layers.0.mlp": hf_out})
    full = {"prefill/model.layers.0.mlp": (hf_out[:2].clone(), None),
            "decode/model.layers.0.mlp": (-hf_out[2:], None)}
    other = {r.module: r.vs_hf for r in _rows(full, None, hf, None, ctx, 2, False)}
    same = {r.module: r.vs_hf for r in _rows(full, None, hf, None, ctx, 2, True)}
    assert other == {"prefill/model.layers.0.mlp": 0.0}, other
    assert same["prefill/model.layers.0.mlp"] == 0.0 and same["decode/model.layers.0.mlp"] > 1


def _record_prefill(case: str, prompt: list[int]) -> dict:
    """Every module's capture of one TP=1 prefill of `prompt` on bundled `case`, by key."""
    folder = GOLDEN / case
    core = EngineCore(folder, load_config(folder),
                      EngineConfig(dtype="float32", progress=False, max_num_seqs=1),
                      torch.device("cpu"))
    return record_modules(core, prompt)


def test_quantized_modules_are_recorded_in_their_layouts():
    """Block-FP8 Qwen3.5-MoE: GDN in_proj, split into a quantized [q | k | v | z] GEMM and a
    bf16 [b | a] one (`in_proj_ba`), is stated as four head-split segments and in_proj_ba as
    two (unquantized, in_proj keeps all six); a quantized row-parallel output's
    pre-reduction partial is its input times the dequantized weight (at TP 1 the output)."""
    key, value, heads = ("split", 128, 1), ("split", 192, 1), ("split", 16, 1)
    gdn = "prefill/model.layers.0.linear_attn"
    fp8 = _record_prefill("tiny-qwen3.5-moe-fp8", [3, 1, 4, 1, 5])
    assert fp8[f"{gdn}.in_proj"].layout == ("segments", (key, key, value, value))
    assert fp8[f"{gdn}.in_proj_ba"].layout == ("segments", (heads, heads))
    for module in (f"{gdn}.out_proj", "prefill/model.layers.1.self_attn.o_proj"):
        full, partial = fp8[module], fp8[f"{module}:partial"]
        assert full.layout == FULL and partial.layout == PARTIAL, module
        assert torch.equal(partial.tensor, full.tensor), module
    plain = _record_prefill("tiny-qwen3.5-moe", [3, 1, 4, 1, 5])
    assert plain[f"{gdn}.in_proj"].layout == ("segments", (key, key, value, value, heads,
                                                           heads))
    assert f"{gdn}.in_proj_ba" not in plain


def _make_bitwise_row(module: str, got: torch.Tensor, want: torch.Tensor) -> Row:
    from freetoken_verify.checks.bisect.table import compare_with_tp1

    row = Row(module)
    compare_with_tp1(row, got, want, bitwise=True)
    return row


def test_bitwise_rows_diverge_on_one_bit_and_count_ulps():
    """In the bitwise mode a module one bf16 ulp off TP=1 in one element diverges (its
    relative L2 is far below any bound), and the row counts the elements and ulps; equal
    bits do not diverge; earlier rows are said to be TP=1's bit for bit."""
    want = torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4)
    got = want.clone()
    got[2, 1] = want[2, 1].view(torch.int16).add(1).view(torch.bfloat16)
    clean = _make_bitwise_row("prefill/model.embed_tokens", want.clone(), want)
    off = _make_bitwise_row("prefill/model.layers.0.self_attn.o_proj", got, want)
    assert not clean.diverged and off.diverged and off.vs_tp1 < 1e-2
    message = Bisection([clean, off], ("TP=1 (bitwise)",)).message()
    assert message.startswith("first divergence: prefill/model.layers.0.self_attn.o_proj "
                              "(1 / 12 elements differ bit for bit from TP=1, rel L2 "), message
    assert ", largest 1 ulp at (2, 1) (" in message, message
    assert message.endswith("; earlier modules bit for bit TP=1's)"), message


def test_bitwise_reduced_output_with_equal_leaves_blames_the_reduction():
    """A row-parallel output that differs from TP=1 while its canonical leaves (recorded
    before the reduction) are TP=1's bits says the reduction differs; different dtypes are a
    divergence of their own."""
    leaves = torch.randn(2, 8)
    out = torch.randn(2, 4)
    other = out.clone()
    other[0, 0] += 1e-3
    rows = [_make_bitwise_row("prefill/o_proj:leaves", leaves.clone(), leaves),
            _make_bitwise_row("prefill/o_proj", other, out)]
    assert "its canonical leaves are bit for bit TP=1's: the reduction differs" in \
        Bisection(rows, ("TP=1 (bitwise)",)).message()
    typed = _make_bitwise_row("prefill/x", out.to(torch.bfloat16), out)
    assert typed.diverged and "dtype bfloat16 where TP=1 has float32" in \
        Bisection([typed]).message()


def test_batched_rows_come_from_each_sequence_at_its_positions():
    """A batched step's HF rows are each sequence's rows at the positions the step holds
    (one per new token), or its last new position (one row per sequence: the LM head); a
    step is compared with TP=1 only while every sequence in it consumed TP=1's ids."""
    from freetoken_verify.checks.bisect.batched import _gather, comparable_steps
    from freetoken_verify.checks.bisect.capture import BatchedCapture, StepLayout

    names = NameMap({"model"}, num_heads=1, head_dim=2)
    per_seq = [(names, {"model.norm": torch.arange(10.0).reshape(5, 2) + 100 * s}, 5)
               for s in range(2)]
    decode = StepLayout(False, ((0, 3, 1), (1, 2, 1)))
    assert _gather(per_seq, "model.norm", decode, 2).tolist() == [[6, 7], [104, 105]]
    prefill = StepLayout(True, ((0, 0, 2), (1, 0, 3)))
    assert _gather(per_seq, "model.norm", prefill, 5)[:, 0].tolist() == [0, 2, 100, 102, 104]
    assert _gather(per_seq, "model.norm", prefill, 2)[:, 0].tolist() == [2, 104]
    assert _gather(per_seq, "model.norm", prefill, 3) is None

    steps = (prefill, StepLayout(False, ((0, 2, 1), (1, 3, 1))),
             StepLayout(False, ((0, 3, 1), (1, 4, 1))))
    prompts = [[1, 2], [3, 4, 5]]
    tp1 = BatchedCapture({}, steps, ((7, 8, 9), (6, 6, 6)))
    same = BatchedCapture({}, steps, ((7, 8, 9), (6, 6, 6)))
    later = BatchedCapture({}, steps, ((7, 1, 9), (6, 6, 6)))
    assert comparable_steps(same, tp1, prompts) == {s.name(i) for i, s in enumerate(steps)}
    assert comparable_steps(later, tp1, prompts) == {steps[0].name(0), steps[1].name(1)}
