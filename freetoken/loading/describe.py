"""A shard plan in words: for one checkpoint tensor, the rule it matches, its spec, where it
goes, and which global rows and columns each rank holds (`freetoken plan` prints this).

The ranges come from the spec itself, not from a second description of it: the spec's
`pieces` are taken of an index tensor (each element holds its own index along one dim,
expanded, so nothing of the tensor's size is allocated), and the indices each piece carries
are read back. Packed tensors name their segments (`q`, `k`, `v`) through `piece_labels`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.formats.shard import ShardSpec
from freetoken.loading.plan import ShardPlan

PAD = "padding"
_DIM_NAMES = ("rows", "cols")


@dataclass(frozen=True)
class TensorLayout:
    """How one checkpoint tensor is split: `ranks[r]` is rank r's holdings, one line."""

    name: str
    shape: tuple[int, ...]
    pattern: str
    spec: str
    destination: str
    ranks: tuple[str, ...]

    def lines(self) -> list[str]:
        """The layout as lines a person reads, the tensor name first."""
        head = [f"{self.name} {list(self.shape)}", f"  rule: {self.pattern}",
                f"  spec: {self.spec}", f"  into: {self.destination}"]
        return head + [f"  rank {r}: {held}" for r, held in enumerate(self.ranks)]


def describe_tensor(plan: ShardPlan, name: str, shape: tuple[int, ...]) -> TensorLayout:
    """The layout of checkpoint tensor `name` (of `shape`) under `plan`; ShardError when it
    matches no rule, two rules, or its rule cannot split it."""
    target = plan.resolve(name)
    spec = target.rule.spec
    if target.param is None:
        checked = target.rule.checked
        return TensorLayout(name, shape, target.rule.pattern,
                            "-" if checked is None else f"checked by {checked!r}", "ignored", ())
    ranks = tuple(_holdings(spec, name, shape, rank, plan.tp_size)
                  for rank in range(plan.tp_size))
    return TensorLayout(name, shape, target.rule.pattern, repr(spec),
                        target.param + _slot_text(target.slot), ranks)


def _slot_text(slot: tuple) -> str:
    if not slot:
        return ""
    parts = [f"{s.start}:{s.stop}" if isinstance(s, slice) else str(s) for s in slot]
    return f"[{', '.join(parts)}]"


def _holdings(spec: ShardSpec, name: str, shape: tuple[int, ...], rank: int, size: int) -> str:
    """Rank `rank`'s global indices along every dim it does not hold whole, e.g.
    `rows q 0:4, k 16:20, v 32:44`; `all` for a whole (replicated) tensor."""
    held = []
    for dim in range(len(shape)):
        runs = _dim_runs(spec, name, shape, dim, rank, size)
        if runs is not None:
            held.append(f"{_dim_name(dim)} {_runs_text(runs)}")
    return "; ".join(held) or "all"


def _dim_name(dim: int) -> str:
    return _DIM_NAMES[dim] if dim < len(_DIM_NAMES) else f"dim {dim}"


def _index_tensor(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """float32 (what global-scale specs accept) holding each element's index along `dim`;
    exact for any dim below 2^24."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return torch.arange(shape[dim], dtype=torch.float32).view(view).expand(shape)


def _dim_runs(spec: ShardSpec, name: str, shape: tuple[int, ...], dim: int, rank: int,
              size: int) -> list[tuple[str | None, list[tuple[int, int]]]] | None:
    """(label, [(start, stop), ...]) of the global indices along `dim` each piece carries,
    in shard order, consecutive pieces with one label merged; None when every piece holds
    the whole dim."""
    pieces = spec.pieces(_index_tensor(shape, dim), rank, size, name).pieces
    labels = getattr(spec, "piece_labels", None)
    names = list(labels(size)) if labels else []
    names += [None] * (len(pieces) - len(names))
    found: list[tuple[str | None, list[int]]] = []
    for piece, label in zip(pieces, names):
        if piece.source is None:
            # Zeros, not checkpoint values: they pad only along their own dim.
            if piece.dim is not None and piece.dim % len(shape) == dim:
                found.append((PAD, [-1] * piece.length))
        else:
            found.append((label, _along(piece.source, dim, len(shape))))
    if all(indices == list(range(shape[dim])) for label, indices in found if label != PAD) \
            and not any(label == PAD for label, _ in found):
        return None
    runs: list[tuple[str | None, list[int]]] = []
    for label, indices in found:
        if runs and runs[-1][0] == label:
            runs[-1][1].extend(indices)
        else:
            runs.append((label, list(indices)))
    return [(label, _ranges(indices)) for label, indices in runs]


def _along(source: torch.Tensor, dim: int, ndim: int) -> list[int]:
    """The indices a piece's source holds along `dim` (a scalar source: index 0)."""
    if source.dim() != ndim:
        return [int(source.reshape(-1)[0])]
    line = source
    for d in reversed(range(ndim)):
        if d != dim:
            line = line.select(d, 0)
    return [int(v) for v in line.tolist()]


def _ranges(indices: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 8, 9] -> [(0, 3), (8, 10)]; padding (-1) -> one (-1, count) run."""
    if indices and indices[0] < 0:
        return [(-1, len(indices))]
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _runs_text(runs: list[tuple[str | None, list[tuple[int, int]]]]) -> str:
    parts = []
    for label, ranges in runs:
        if label == PAD:
            parts.append(f"{PAD} x{ranges[0][1]}")
            continue
        text = ", ".join(f"{a}:{b}" for a, b in ranges)
        parts.append(f"{label} {text}" if label else text)
    return ", ".join(parts)
