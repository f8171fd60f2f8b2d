"""The tp_invariant engine mode end to end: every bundled case, in fp32 and bf16, gives the
same bits at TP 2, 4 and 8 as at TP 1 (prefill logits at every position of every prompt, the
greedy continuation and its per-step logits). One rank group per TP size runs every case."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN

from freetoken.config import EngineConfig
from freetoken.distributed import RankGroup, choose_placement, get_tp_info
from freetoken.engine.core import EngineCore
from freetoken.engine.sequence import SamplingParams
from freetoken.models.registry import load_config

CASES = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5-moe",
         "tiny-qwen3.5-moe-nvfp4"]
DTYPES = ["float32", "bfloat16"]
NEW_TOKENS = 8
DEFAULT_CASE = ("tiny-qwen3-moe", "float32")
"""Also run in the default mode, to show the comparison sees TP's reduction order there."""


def _make_core(ctx, case: str, dtype: str, tp_invariant: bool) -> EngineCore:
    folder = GOLDEN / case
    cfg = EngineConfig(dtype=dtype, progress=False, tp_invariant=tp_invariant, max_num_seqs=4,
                       max_model_len=128)
    return EngineCore(folder, load_config(folder), cfg, ctx.device)


def _rank_outputs(ctx, runs: list[tuple[str, str, bool]]):
    """Per (case, dtype, invariant): each prompt's (prompt logits, step logits, token ids);
    rank 0 returns them."""
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True,
                            return_prompt_logits=True)
    out = {}
    for case, dtype, invariant in runs:
        prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
        results = _make_core(ctx, case, dtype, invariant).generate(
            prompts, [params] * len(prompts))
        out[case, dtype, invariant] = [(r.prompt_logits, r.logits, r.token_ids)
                                       for r in results]
    return out if get_tp_info().is_first else None


def _make_outputs(tp: int) -> dict:
    runs = [(c, d, True) for c in CASES for d in DTYPES] + [(*DEFAULT_CASE, False)]
    group = RankGroup(tp, choose_placement("cpu", tp), timeout=600.0)
    group.start()
    try:
        return group.run(_rank_outputs, runs)[0]
    finally:
        group.close()


@pytest.fixture(scope="module")
def tp1_outputs() -> dict:
    return _make_outputs(1)


def _differing(a: torch.Tensor, b: torch.Tensor) -> str:
    """`k / n differ, worst abs d at index i` for two same-shaped tensors."""
    diff = (a.double() - b.double()).abs()
    worst = int(diff.argmax())
    return (f"{int((a != b).sum())} / {a.numel()} differ, worst abs {diff.max().item():.3g} "
            f"at flat index {worst}")


def _assert_bitwise(got, want, label: str) -> None:
    """Prompt logits, step logits and token ids identical, bit for bit, per prompt."""
    for i, ((p_got, s_got, ids_got), (p_want, s_want, ids_want)) in enumerate(zip(got, want)):
        assert ids_got == ids_want, f"{label} prompt {i}: greedy {ids_got} != {ids_want}"
        for name, a, b in (("prefill logits", p_got, p_want), ("decode logits", s_got, s_want)):
            assert a.shape == b.shape, f"{label} prompt {i} {name}: {a.shape} != {b.shape}"
            assert torch.equal(a, b), f"{label} prompt {i} {name}: {_differing(a, b)}"


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_invariant_mode_is_bitwise_tp1(tp, tp1_outputs):
    """In the tp_invariant mode every bundled case (fp32 and bf16) has bit-identical prefill
    logits at every position, greedy tokens and decode logits at TP=`tp` and TP=1; in the
    default mode TP's reduction order shows in the bits (so the comparison can fail)."""
    outputs = _make_outputs(tp)
    for case in CASES:
        for dtype in DTYPES:
            key = (case, dtype, True)
            _assert_bitwise(outputs[key], tp1_outputs[key], f"{case} {dtype} tp={tp}")
    default = (*DEFAULT_CASE, False)
    same = all(torch.equal(a[0], b[0]) for a, b in zip(outputs[default], tp1_outputs[default]))
    assert not same, f"{DEFAULT_CASE} default mode: tp={tp} logits equal TP 1's bit for bit"
