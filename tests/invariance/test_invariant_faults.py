"""Faults that only a zero-tolerance comparison sees (`freetoken_verify.faults.invariant`, the
ones `--fault` injects), each in the dtype the catalogue lists it in, injected into the
tp_invariant engine at TP=2 (tiny-qwen3-moe; the q/k norm fault on tiny-qwen3, whose
attention has q/k norms): each moves the logits (prefill at every position, and the greedy
steps') off TP=1's bits while staying inside the harness's default bound for the dtype, and
removing it restores the bits."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM, SamplingParams
from freetoken.layers import invariant
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken_verify.faults import FAULTS

BF16_MAX_REL_L2 = 5e-2
BF16_MAX_KL = 5e-2
"""The harness's default bf16 bounds on logits: relative L2 and mean KL(TP=1 || TP=N)."""
FP32_BOUND = 1e-4
"""The harness's default fp32 bound: rtol = atol = 1e-4, elementwise."""

FAULTS_BY_DTYPE = {
    ("bfloat16", "tiny-qwen3-moe"): ("invariant-bf16-wire", "invariant-subtree-bf16",
                                     "rotary-bf16-on-ranks"),
    ("bfloat16", "tiny-qwen3"): ("qk-norm-variance-bf16-on-ranks",),
    # In bf16 these vanish in the final rounding (the logits keep their bits).
    ("float32", "tiny-qwen3-moe"): ("invariant-leaves-left-to-right",
                                    "invariant-tree-order-swapped", "invariant-tiles-by-width"),
}
_PATCHED = ((invariant, "finish"), (invariant, "reduce_subtrees"),
            (invariant, "column_linear"), (RotaryEmbedding, "cos_sin"), (RMSNorm, "forward"))
"""Everything these faults replace; on a rank, this module is imported before any of them."""
_CLEAN = tuple(getattr(owner, name) for owner, name in _PATCHED)


def _set_fault(core, name: str | None) -> None:
    """On a rank: the engine with fault `name` in it (None: the real one)."""
    for (owner, attr), clean in zip(_PATCHED, _CLEAN):
        setattr(owner, attr, clean)
    if name:
        FAULTS[name]()


def _make_llm(case: str, tp: int, dtype: str) -> LLM:
    return LLM(GOLDEN / case, tp=tp, device="cpu", dtype=dtype, progress=False,
               tp_invariant=True, max_num_seqs=4, max_model_len=128)


def _logits(llm: LLM, case: str) -> list[torch.Tensor]:
    """Per prompt: the prefill logits at every position, then the 4 greedy steps' logits."""
    prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=4, ignore_eos=True, return_prompt_logits=True,
                            return_logits=True)
    return [torch.cat([r.prompt_logits, r.logits]) for r in llm.generate(prompts, params)]


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


@pytest.mark.parametrize("dtype, case", list(FAULTS_BY_DTYPE))
def test_invariant_faults_break_the_bits(dtype, case):
    """Each fault listed for `dtype` and `case`, at TP=2, changes the logits (zero tolerance
    catches it) by less than the default bound (a tolerance would pass it); without a fault,
    TP=2 is TP=1 bit for bit, before and after."""
    with _make_llm(case, 1, dtype) as llm:
        tp1 = _logits(llm, case)
    with _make_llm(case, 2, dtype) as llm:
        _assert_same_bits(_logits(llm, case), tp1, f"{dtype} tp=2 clean")
        for name in FAULTS_BY_DTYPE[dtype, case]:
            llm.run_on_ranks(_set_fault, name)
            _assert_only_bitwise_sees(_logits(llm, case), tp1, dtype, f"{dtype} tp=2 {name}")
            llm.run_on_ranks(_set_fault, None)
        _assert_same_bits(_logits(llm, case), tp1, f"{dtype} tp=2 after the faults")
