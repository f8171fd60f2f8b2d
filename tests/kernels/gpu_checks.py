"""What the GPU tests of the engine's kernels share: the relative L2 error against a
reference, and the check that a CUDA graph's replay equals the eager call bit for bit."""

from __future__ import annotations

import torch


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def assert_graph_equals_eager(fn, what: str) -> None:
    """`fn()` captured in a CUDA graph and replayed gives exactly what it gives eagerly."""
    eager = fn()
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"{what}: graph replay differs from the eager call"
