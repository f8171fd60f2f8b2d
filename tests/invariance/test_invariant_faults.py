"""Faults that only a zero-tolerance comparison sees: injected into the tp_invariant mode's
reduction at TP=2 (tiny-qwen3-moe; two in bf16, one in fp32), each moves the logits off TP=1's
bits while staying inside the harness's default bound for the dtype, and removing it restores
the bits."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM, SamplingParams
from freetoken.distributed import get_communicator, get_tp_info
from freetoken.distributed.comm import tree_sum
from freetoken.layers import invariant

CASE = "tiny-qwen3-moe"
BF16_MAX_REL_L2 = 5e-2
BF16_MAX_KL = 5e-2
"""The harness's default bf16 bounds on logits: relative L2 and mean KL(TP=1 || TP=N)."""
FP32_BOUND = 1e-4
"""The harness's default fp32 bound: rtol = atol = 1e-4, elementwise."""


def _bf16_wire(subtree: torch.Tensor) -> torch.Tensor:
    """Fault: the invariant all-reduce sums bf16 partials (the backend's own sum order)."""
    return get_communicator().all_reduce(subtree.to(torch.bfloat16)).to(subtree.dtype)


def _rank1_subtree_in_bf16(subtree: torch.Tensor) -> torch.Tensor:
    """Fault: rank 1 rounds its subtree sum to bf16 before the reduction."""
    if get_tp_info().rank == 1:
        subtree = subtree.to(torch.bfloat16).to(subtree.dtype)
    return get_communicator().all_reduce_tree(subtree)


def _rank1_leaves_left_to_right(leaves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fault: rank 1 sums its leaves left to right instead of in the tree (swapping a pair's
    operands would change nothing: IEEE addition commutes; the tree's shape is the order)."""
    parts = list(leaves.unbind(0))
    if get_tp_info().rank == 1:
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        parts = [total]
    return invariant.reduce_subtrees(tree_sum(parts)).to(dtype)


FAULTS = {
    "bf16 partials on the wire": ("bfloat16", "reduce_subtrees", _bf16_wire),
    "rank 1 subtree rounded to bf16": ("bfloat16", "reduce_subtrees", _rank1_subtree_in_bf16),
    # In bf16 this one vanishes in the final rounding (the logits keep their bits).
    "rank 1 leaves summed left to right": ("float32", "finish", _rank1_leaves_left_to_right),
}
_CLEAN = {"reduce_subtrees": invariant.reduce_subtrees, "finish": invariant.finish}


def _set_reduction(core, name: str | None) -> None:
    """On a rank: the invariant reduction with fault `name` in it (None: the real one)."""
    for attr, clean in _CLEAN.items():
        setattr(invariant, attr, clean)
    if name:
        _, attr, fault = FAULTS[name]
        setattr(invariant, attr, fault)


def _make_llm(tp: int, dtype: str) -> LLM:
    return LLM(GOLDEN / CASE, tp=tp, device="cpu", dtype=dtype, progress=False,
               tp_invariant=True, max_num_seqs=4, max_model_len=128)


def _prompt_logits(llm: LLM) -> list[torch.Tensor]:
    prompts = json.loads((GOLDEN / CASE / "meta.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=1, ignore_eos=True, return_prompt_logits=True)
    return [r.prompt_logits for r in llm.generate(prompts, params)]


def _assert_same_bits(got, want, label: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{label} prompt {i}: {int((a != b).sum())} logits differ"


def _distance(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(relative L2, mean KL(want || got) over positions) of two logit tensors."""
    rel_l2 = ((got - want).norm() / want.norm()).item()
    log_want, log_got = want.log_softmax(-1), got.log_softmax(-1)
    kl = (log_want.exp() * (log_want - log_got)).sum(-1).mean().item()
    return rel_l2, kl


def _assert_within_default_tolerance(a: torch.Tensor, b: torch.Tensor, dtype: str,
                                     label: str) -> None:
    """The harness's default bound for `dtype` passes `a` against `b`."""
    if dtype == "float32":
        torch.testing.assert_close(a, b, rtol=FP32_BOUND, atol=FP32_BOUND,
                                   msg=lambda m: f"{label}: {m} (a tolerance would catch it)")
        return
    rel_l2, kl = _distance(a, b)
    assert rel_l2 <= BF16_MAX_REL_L2 and kl <= BF16_MAX_KL, (
        f"{label}: rel L2 {rel_l2:.3g}, KL {kl:.3g} exceed the default bf16 bounds "
        f"{BF16_MAX_REL_L2}, {BF16_MAX_KL} (a tolerance would catch this fault)")


def _assert_only_bitwise_sees(got, want, dtype: str, label: str) -> None:
    """Some logit differs from TP=1's, and every prompt is within the default bound."""
    assert any(not torch.equal(a, b) for a, b in zip(got, want)), \
        f"{label}: the faulted TP=2 logits equal TP=1's bit for bit"
    for i, (a, b) in enumerate(zip(got, want)):
        _assert_within_default_tolerance(a, b, dtype, f"{label} prompt {i}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_invariant_reduction_faults_break_the_bits(dtype):
    """Each fault of FAULTS for `dtype` at TP=2 changes the logits (zero tolerance catches
    it) by less than the default bound (a tolerance would pass it); without a fault, TP=2 is
    TP=1 bit for bit, before and after."""
    with _make_llm(1, dtype) as llm:
        tp1 = _prompt_logits(llm)
    with _make_llm(2, dtype) as llm:
        _assert_same_bits(_prompt_logits(llm), tp1, f"{dtype} tp=2 clean")
        for name in (n for n, (d, _, _) in FAULTS.items() if d == dtype):
            llm.run_on_ranks(_set_reduction, name)
            _assert_only_bitwise_sees(_prompt_logits(llm), tp1, dtype, f"{dtype} tp=2 {name}")
            llm.run_on_ranks(_set_reduction, None)
        _assert_same_bits(_prompt_logits(llm), tp1, f"{dtype} tp=2 after the faults")
