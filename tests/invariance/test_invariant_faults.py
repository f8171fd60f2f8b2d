"""Faults that only a zero-tolerance comparison sees: injected into the tp_invariant mode's
reduction at TP=2 (bf16, tiny-qwen3-moe), each moves the logits off TP=1's bits while
staying inside the harness's default bf16 bound, and removing it restores the bits."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM, SamplingParams
from freetoken.distributed import get_communicator, get_tp_info
from freetoken.layers import invariant

CASE = "tiny-qwen3-moe"
BF16_MAX_REL_L2 = 5e-2
BF16_MAX_KL = 5e-2
"""The harness's default bf16 bounds on logits: relative L2 and mean KL(TP=1 || TP=N)."""


def _bf16_wire(subtree: torch.Tensor) -> torch.Tensor:
    """Fault: the invariant all-reduce sums bf16 partials (the backend's own sum order)."""
    return get_communicator().all_reduce(subtree.to(torch.bfloat16)).to(subtree.dtype)


def _rank1_subtree_in_bf16(subtree: torch.Tensor) -> torch.Tensor:
    """Fault: rank 1 rounds its subtree sum to bf16 before the reduction."""
    if get_tp_info().rank == 1:
        subtree = subtree.to(torch.bfloat16).to(subtree.dtype)
    return get_communicator().all_reduce_tree(subtree)


FAULTS = {"bf16 partials on the wire": _bf16_wire,
          "rank 1 subtree rounded to bf16": _rank1_subtree_in_bf16}
_CLEAN = invariant.reduce_subtrees


def _set_reduction(core, name: str | None) -> None:
    """On a rank: the invariant reduction replaced by fault `name` (None: the real one)."""
    invariant.reduce_subtrees = FAULTS[name] if name else _CLEAN


def _make_llm(tp: int) -> LLM:
    return LLM(GOLDEN / CASE, tp=tp, device="cpu", dtype="bfloat16", progress=False,
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


def _assert_only_bitwise_sees(got, want, label: str) -> None:
    """Some logit differs from TP=1's, and every prompt is within the default bf16 bounds."""
    assert any(not torch.equal(a, b) for a, b in zip(got, want)), \
        f"{label}: the faulted TP=2 logits equal TP=1's bit for bit"
    for i, (a, b) in enumerate(zip(got, want)):
        rel_l2, kl = _distance(a, b)
        assert rel_l2 <= BF16_MAX_REL_L2 and kl <= BF16_MAX_KL, (
            f"{label} prompt {i}: rel L2 {rel_l2:.3g}, KL {kl:.3g} exceed the default bf16 "
            f"bounds {BF16_MAX_REL_L2}, {BF16_MAX_KL} (a tolerance would catch this fault)")


@pytest.fixture(scope="module")
def tp1_logits() -> list[torch.Tensor]:
    with _make_llm(1) as llm:
        return _prompt_logits(llm)


def test_invariant_reduction_faults_break_the_bits(tp1_logits):
    """Each fault of FAULTS at TP=2 changes the logits (zero tolerance catches it) by less
    than the default bf16 bound (a tolerance would pass it); without a fault, TP=2 is TP=1
    bit for bit, before and after."""
    with _make_llm(2) as llm:
        _assert_same_bits(_prompt_logits(llm), tp1_logits, "tp=2 clean")
        for name in FAULTS:
            llm.run_on_ranks(_set_reduction, name)
            _assert_only_bitwise_sees(_prompt_logits(llm), tp1_logits, f"tp=2 {name}")
            llm.run_on_ranks(_set_reduction, None)
        _assert_same_bits(_prompt_logits(llm), tp1_logits, "tp=2 after the faults")
