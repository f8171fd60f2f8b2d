"""Decode from CUDA graph replay against the same decode run eagerly, bit for bit.

Where the engine replays decode steps from CUDA graphs, the golden check reruns a greedy
continuation at batch sizes that fill their graph bucket (1, and the largest power of two the
prompts allow) with the graphs and then with them switched off: the same kernels on the same
inputs must give the same logits to the last bit. A stale static input buffer (a position,
slot or block table not refreshed before a replay), a padding row that leaks into real rows
or a capture that baked in a per-step value shows up here as the first step and sequence
whose logits differ, while a tolerance against HF would let a small drift pass."""

from __future__ import annotations

import torch

from freetoken.engine.sequence import SamplingParams


def batch_sizes(num_prompts: int) -> list[int]:
    """Batch sizes that fill their bucket exactly (a padded bucket runs the matrix products
    at another shape than eager, and may round differently)."""
    return sorted({1, 1 << (max(1, num_prompts).bit_length() - 1)})


def _decode(core, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    params = SamplingParams(max_tokens=steps, ignore_eos=True, return_logits=True)
    return [r.logits for r in core.generate(prompts, [params] * len(prompts))]


def graph_replay_mismatch(core, prompts: list[list[int]], steps: int) -> str | None:
    """None when every decode step replayed from the engine's CUDA graphs equals the eager
    step bit for bit (or the engine does not use graphs); else where they first differ.
    Runs on every rank (the steps' collectives need all of them)."""
    if core.graphs is None:
        return None
    for n in batch_sizes(len(prompts)):
        graphed = _decode(core, prompts[:n], steps)
        graphs, core.graphs = core.graphs, None
        try:
            eager = _decode(core, prompts[:n], steps)
        finally:
            core.graphs = graphs
        for i, (g_steps, e_steps) in enumerate(zip(graphed, eager)):
            for step, (g, e) in enumerate(zip(g_steps, e_steps)):
                if not torch.equal(g, e):
                    worst = float((g.float() - e.float()).abs().max())
                    return (f"CUDA graph replay differs from eager decode at batch {n}: "
                            f"prompt {i} step {step} logits, max abs {worst:.3e} (a static "
                            "graph input not refreshed, or padding leaking into real rows)")
    return None
