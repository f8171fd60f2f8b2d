"""What a rank holds against its layout statement (`freetoken_verify.checks.shards.layouts`), bit
for bit, row by
row: the expected local tensor is the full checkpoint tensor indexed with the statement's
global index list, and the first wrong local row is reported with the global row it holds and
the one it should hold."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from freetoken_verify.checks.shards.layouts import PAD, Statement

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of the same width: comparisons are then bitwise (NaN, -0.0)
    and work for float8, which CPU torch cannot compare."""
    if t.dtype.is_floating_point:
        return t.contiguous().view(_INT_OF_SIZE[t.element_size()])
    return t


def expected_local(st: Statement, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s local tensor by the statement, as bits (see `bits`)."""
    b = bits(full)
    if st.dim is None:
        return b
    index = st.index(rank, tp)
    out = b.index_select(st.dim, index.clamp(min=0))
    pad = (index == PAD).nonzero().flatten()
    if len(pad):
        out.index_fill_(st.dim, pad, 0)
    return out


def _where(st: Statement, index: int) -> str:
    what = "padding (zeros)" if index == PAD else f"global {_global_word(st)} {index}"
    return what if index == PAD else f"{what} ({st.describe(index)})"


def _word(st: Statement) -> str:
    return "row" if st.dim == 0 else "column"


def _global_word(st: Statement) -> str:
    """What one global index of the tensor is: a row, or a block scale's block row."""
    return f"block {_word(st)}" if st.block else _word(st)


def _find(st: Statement, full_bits: torch.Tensor, line: torch.Tensor) -> int | None:
    """The first global row (column) of `full_bits` equal to `line`, or None."""
    if full_bits.dim() <= st.dim or full_bits.dtype != line.dtype or \
            full_bits.select(st.dim, 0).shape != line.shape:
        return None
    match = (full_bits == line.unsqueeze(st.dim))
    match = match.flatten(st.dim + 1).all(-1) if match.dim() > st.dim + 1 else match
    if st.dim == 1:
        match = match.all(0)
    hits = match.nonzero().flatten().tolist()
    return hits[0] if hits else None


def _held(st: Statement, full_bits: torch.Tensor, line: torch.Tensor,
          others: Callable[[], Iterable[tuple[Statement, torch.Tensor]]]) -> str:
    """Which global row (column) `line` is, by content: of this checkpoint tensor, else of
    one of `others` (the tensors sharing its engine parameter)."""
    hit = _find(st, full_bits, line)
    if hit is not None:
        return _where(st, hit)
    for other, tensor in others():
        hit = _find(other, bits(tensor), line) if other.dim == st.dim else None
        if hit is not None:
            return f"{other.name} {_where(other, hit)}"
    return "zeros" if not bool(line.any()) else f"no {_word(st)} of the checkpoint tensor"


def mismatch(st: Statement, full: torch.Tensor, held: torch.Tensor, rank: int, tp: int,
             others: Callable[[], Iterable[tuple[Statement, torch.Tensor]]] = tuple
             ) -> str | None:
    """None when `held` (rank `rank`'s tensor) is what the statement says, bit for bit;
    else one line: the shape, or the first wrong local row, what it holds (looked up in
    `others()` too when it is no row of this tensor) and what it should hold."""
    want = expected_local(st, full, rank, tp)
    got = bits(held)
    if st.dim is None:
        got, want = got.reshape(-1), want.reshape(-1)
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return (f"holds shape {tuple(held.shape)} {held.dtype}, the layout gives "
                f"{tuple(want.shape)} {full.dtype}")
    wrong = got != want
    if not bool(wrong.any()):
        return None
    if st.dim is None:
        return _whole_mismatch(st, full, held, wrong, others)
    per_line = wrong.movedim(st.dim, 0).flatten(1).any(1) if wrong.dim() > 1 else wrong
    local = int(per_line.nonzero()[0])
    expected = int(st.index(rank, tp)[local])
    line = got.select(st.dim, local)
    return (f"local {_word(st)} {local} holds {_held(st, bits(full), line, others)}, expected "
            f"{_where(st, expected)}; {int(per_line.sum())} / {per_line.numel()} "
            f"{_word(st)}s wrong")


def _values(t: torch.Tensor) -> str:
    return ", ".join(f"{v:.6g}" for v in t.double().flatten().tolist())


def _whole_mismatch(st: Statement, full: torch.Tensor, held: torch.Tensor,
                    wrong: torch.Tensor, others) -> str:
    """A replicated tensor that is not the checkpoint's: for a scale (a few elements) the
    values held and expected, and which tensor of the same destination the held value is."""
    if full.numel() > 4:
        return (f"replicated tensor differs from the checkpoint tensor "
                f"({int(wrong.sum())} / {wrong.numel()} elements)")
    got = bits(held).reshape(-1)
    owner = next((other.name for other, tensor in others() if other.dim is None and
                  tensor.numel() == held.numel() and tensor.dtype == held.dtype and
                  torch.equal(bits(tensor).reshape(-1), got)), None)
    what = f" ({owner}'s value)" if owner else ""
    return f"holds {_values(held)}{what}, expected {_values(full)} (the checkpoint's)"


def identical_to(st: Statement, full: torch.Tensor, shards: dict[int, torch.Tensor],
                 rank: int, tp: int) -> int | None:
    """A lower rank whose shard equals rank `rank`'s although the statement gives the two
    ranks checkpoint slices that differ (e.g. every rank handed the first heads)."""
    mine, want = bits(shards[rank]), expected_local(st, full, rank, tp)
    for other in range(rank):
        theirs = bits(shards[other])
        if theirs.shape == mine.shape and torch.equal(theirs, mine) and \
                not torch.equal(expected_local(st, full, other, tp), want):
            return other
    return None
