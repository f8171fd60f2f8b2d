"""Exercises a rank's Communicator with inputs of every layout the engine could hand it:
contiguous, transposed, strided and offset slices, odd shapes, 0-d and one-element tensors, in
float32 and bfloat16. Each rank's values follow from its rank id, so the sum, the gather and
the broadcast are known exactly on every rank. Every collective is checked for the returned
value, for the input updated in place (all_reduce and broadcast promise it) and for storage
outside the input's view left untouched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.distributed import Communicator

_SENTINEL = -7.0
_ODD = (3, 5, 7)


@dataclass(frozen=True)
class Layout:
    """How an input of `shape` sits in its parent storage: `parent_shape(shape)` is the
    storage's shape and `select(parent)` the input's view of it."""

    name: str
    parent_shape: Callable[[tuple], tuple]
    select: Callable[[torch.Tensor], torch.Tensor]


def _reversed_dims(t: torch.Tensor) -> torch.Tensor:
    return t.permute(*reversed(range(t.dim())))


LAYOUTS = {
    "contiguous": Layout("contiguous", lambda s: s, lambda p: p),
    "transposed": Layout("transposed (dims reversed)", lambda s: tuple(reversed(s)),
                         _reversed_dims),
    "strided": Layout("strided slice (every other element of the last dim)",
                      lambda s: (*s[:-1], 2 * s[-1]), lambda p: p[..., ::2]),
    "offset": Layout("offset slice (last dim narrowed from 1)", lambda s: (*s[:-1], s[-1] + 3),
                     lambda p: p[..., 1 : p.shape[-1] - 2]),
}


@dataclass(frozen=True)
class ProbeCase:
    op: str
    layout: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int = -1

    def describe(self, x: torch.Tensor) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        along = f", dim={self.dim}" if self.op == "all_gather" else ""
        return (f"Communicator.{self.op} on a {LAYOUTS[self.layout].name} [{dims}] "
                f"{str(self.dtype).removeprefix('torch.')} input (strides {tuple(x.stride())}"
                f"{along})")


def probe_cases() -> list[ProbeCase]:
    """Every (op, layout, shape, dtype) the probe runs, the same list on every rank."""
    cases = []
    for op in ("all_reduce", "broadcast"):
        for dtype in (torch.float32, torch.bfloat16):
            cases += [ProbeCase(op, layout, _ODD, dtype) for layout in LAYOUTS]
            cases += [ProbeCase(op, "offset", (5, 7), dtype),
                      ProbeCase(op, "contiguous", (), dtype),
                      ProbeCase(op, "contiguous", (1,), dtype)]
    for dim in (0, 1, -1):
        cases += [ProbeCase("all_gather", layout, _ODD, torch.float32, dim)
                  for layout in ("contiguous", "transposed", "strided")]
    cases += [ProbeCase("all_gather", "transposed", _ODD, torch.bfloat16, -1),
              ProbeCase("all_gather", "offset", (5, 7), torch.bfloat16, 0),
              ProbeCase("all_gather", "contiguous", (1,), torch.float32, 0)]
    return cases


def rank_values(case: ProbeCase, rank: int, device=None) -> torch.Tensor:
    """Rank `rank`'s logical input: distinct per element and per rank, and small enough in
    bfloat16 that a sum over 8 ranks stays exact."""
    i = torch.arange(max(1, torch.Size(case.shape).numel()), dtype=torch.float64, device=device)
    values = i + 1 + 1000 * rank if case.dtype == torch.float32 else i % 13 + 1 + rank
    return values.reshape(case.shape).to(case.dtype)


def expected(case: ProbeCase, size: int, device=None) -> torch.Tensor:
    """What every rank must get back from `case` on `size` ranks."""
    parts = [rank_values(case, r, device) for r in range(size)]
    if case.op == "all_reduce":
        return torch.stack([p.double() for p in parts]).sum(0).to(case.dtype)
    if case.op == "all_gather":
        return torch.cat(parts, dim=case.dim)
    return parts[size - 1]


def make_input(case: ProbeCase, rank: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent, x): x is the case's input laid out in parent, whose other elements hold a
    sentinel."""
    layout = LAYOUTS[case.layout]
    parent = torch.full(layout.parent_shape(case.shape), _SENTINEL, dtype=case.dtype,
                        device=device)
    x = layout.select(parent)
    x.copy_(rank_values(case, rank, device))
    return parent, x


def _run(comm: Communicator, case: ProbeCase, x: torch.Tensor, size: int) -> torch.Tensor:
    if case.op == "all_reduce":
        return comm.all_reduce(x)
    if case.op == "all_gather":
        return comm.all_gather(x, dim=case.dim)
    return comm.broadcast(x, src=size - 1)


def _differs(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when equal, else how many elements differ and the first of them."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {list(got.shape)} {got.dtype}, expected {list(want.shape)} {want.dtype}"
    bad = (got != want).nonzero()
    if not len(bad):
        return ""
    first = tuple(bad[0].tolist())
    return (f"{len(bad)} / {want.numel()} elements differ, first at {list(first)}: "
            f"{got[first].item()}, expected {want[first].item()}")


def _judge(case: ProbeCase, size: int, parent, x, returned) -> tuple[str, str]:
    """('', '') when the case passed, else (what is wrong, the rank-specific evidence)."""
    want = expected(case, size, x.device)
    what = {"all_reduce": f"the sum over {size} ranks",
            "all_gather": "every rank's input concatenated in rank order",
            "broadcast": f"rank {size - 1}'s input"}[case.op]
    diff = _differs(returned, want)
    if diff:
        return f"returned tensor is not {what}", diff
    if case.op != "all_gather" and _differs(x, want):
        return "input not updated in place", _differs(x, want)
    outside = torch.ones(parent.shape, dtype=torch.bool, device=parent.device)
    LAYOUTS[case.layout].select(outside).fill_(False)
    if bool((parent[outside] != _SENTINEL).any()):
        return "wrote to storage outside the input's view", ""
    return "", ""


def probe_communicator(comm: Communicator, rank: int, size: int,
                       device=None) -> list[tuple[str, str]]:
    """Run every probe case through `comm` on this rank; returns (headline, evidence) per
    failed case, the headline naming the op, the input's layout and what went wrong (the same
    on every rank), the evidence this rank's first wrong element."""
    failures = []
    for case in probe_cases():
        parent, x = make_input(case, rank, device)
        layout = case.describe(x)
        problem, evidence = _judge(case, size, parent, x, _run(comm, case, x, size))
        if problem:
            failures.append((f"{layout}: {problem}", evidence))
    return failures
