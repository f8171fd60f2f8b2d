"""The graph-versus-eager comparison of the golden check
(`freetoken_verify.checks.golden.graph_replay`): it compares
only where the engine graphs, at batch sizes that fill their bucket, restores the graphs
after the eager run, and names the batch, prompt and step of the first bit that differs.
The engine itself graphs only on CUDA (tests/engine/test_cuda_engine.py and the catalogue's
`graph-stale-positions` entry run it there); here a stand-in engine plays both modes."""

from __future__ import annotations

import torch

from freetoken_verify.checks.golden.graph_replay import batch_sizes, graph_replay_mismatch


class _Result:
    def __init__(self, logits):
        self.logits = logits


class _FakeCore:
    """generate() returns per-step logits; with graphs on, step `bad_step` of prompt
    `bad_prompt` is off by `delta` (a stale static input would do that)."""

    def __init__(self, bad_prompt=None, bad_step=None, delta=0.0):
        self.graphs = object()
        self.calls = []
        self.bad = (bad_prompt, bad_step, delta)

    def generate(self, prompts, params):
        graphed = self.graphs is not None
        self.calls.append((len(prompts), graphed))
        out = []
        for i, p in enumerate(prompts):
            steps = [torch.full((5,), float(sum(p) + s)) for s in range(params[0].max_tokens)]
            if graphed and i == self.bad[0]:
                steps[self.bad[1]] = steps[self.bad[1]] + self.bad[2]
            out.append(_Result(steps))
        return out


def _make_prompts(n):
    return [[1 + i, 2] for i in range(n)]


def test_batch_sizes_fill_their_bucket():
    """1 and the largest power of two the prompts allow."""
    assert batch_sizes(1) == [1]
    assert batch_sizes(3) == [1, 2]
    assert batch_sizes(8) == [1, 8]


def test_equal_replay_passes_and_graphs_are_restored():
    """Identical logits: no finding; each batch size ran graphed then eager; the engine's
    graphs are back in place afterwards."""
    core = _FakeCore()
    graphs = core.graphs
    assert graph_replay_mismatch(core, _make_prompts(3), 4) is None
    assert core.calls == [(1, True), (1, False), (2, True), (2, False)]
    assert core.graphs is graphs


def test_one_differing_bit_is_named():
    """The smallest difference fails, naming batch, prompt and step."""
    core = _FakeCore(bad_prompt=1, bad_step=3, delta=2.0 ** -20)
    found = graph_replay_mismatch(core, _make_prompts(3), 4)
    assert found is not None and "batch 2: prompt 1 step 3" in found, found


def test_engine_without_graphs_is_not_compared():
    """No graphs (CPU, gloo, --enforce-eager): nothing runs, nothing is reported."""
    core = _FakeCore()
    core.graphs = None
    assert graph_replay_mismatch(core, _make_prompts(3), 4) is None and core.calls == []
