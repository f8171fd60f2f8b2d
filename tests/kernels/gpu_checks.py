"""What the GPU tests of the engine's kernels share: the relative L2 error against a
reference, and the check that a CUDA graph's replay equals the eager call bit for bit."""

from __future__ import annotations

import torch


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def assert_graph_equals_eager(fn, what: str, want: torch.Tensor | None = None,
                              replays: int = 1) -> None:
    """`fn()` captured in a CUDA graph and replayed (`replays` times) gives exactly what it
    gives eagerly, or `want` where given."""
    eager = fn() if want is None else want
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{what}: graph replay differs from the eager call"
