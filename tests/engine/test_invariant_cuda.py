"""The tp_invariant engine on a GPU (skipped without one), bf16: every bundled case's prompt
logits, greedy tokens and step logits at TP 2 (gloo ranks sharing the GPU, eager) are TP 1's
(CUDA graphs on) bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "config.json").is_file())


def _uses_graphs(core) -> bool:
    return core.use_graphs


def _run(case: str, tp: int):
    prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=6, ignore_eos=True, return_prompt_logits=True,
                            return_logits=True)
    with LLM(GOLDEN / case, tp=tp, device="cuda", dtype="bfloat16", progress=False,
             oversubscribe=True, tp_invariant=True) as llm:
        graphs = llm.run_on_ranks(_uses_graphs)[0]
        return llm.generate(prompts, params), graphs


@pytest.mark.parametrize("case", CASES)
def test_tp2_is_tp1_bit_for_bit(case):
    one, graphs = _run(case, 1)
    assert graphs, f"{case}: TP 1 did not run its decode as CUDA graphs"
    two, _ = _run(case, 2)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a.token_ids == b.token_ids, f"{case} prompt {i}: {a.token_ids} != {b.token_ids}"
        for name in ("prompt_logits", "logits"):
            x, y = getattr(a, name), getattr(b, name)
            differ = int((x != y).sum())
            assert differ == 0, (f"{case} prompt {i} {name}: {differ} / {x.numel()} elements "
                                 f"differ, largest {float((x - y).abs().max()):.3g}")
