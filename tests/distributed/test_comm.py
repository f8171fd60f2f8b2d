"""The Communicator's in-place collectives act on a view's own elements whatever its layout:
a strided slice is summed (or overwritten) element by element and the storage between its
elements is left alone."""

import pytest
import torch

from freetoken.distributed import RankGroup, choose_placement, get_communicator

_SHAPE = (5, 7)


def _values(rank: int) -> torch.Tensor:
    return torch.arange(35.0).reshape(_SHAPE) + 100 * rank


def _strided(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent, view): the view is every other column of the parent; the columns between
    hold -1, which no collective may touch."""
    parent = torch.full((_SHAPE[0], 2 * _SHAPE[1]), -1.0)
    parent[:, ::2] = _values(rank)
    return parent, parent[:, ::2]


def _rank_in_place_ops(ctx) -> dict:
    comm, out = get_communicator(), {}
    for op, call in (("all_reduce", comm.all_reduce),
                     ("broadcast", lambda x: comm.broadcast(x, src=ctx.size - 1))):
        parent, view = _strided(ctx.rank)
        returned = call(view)
        out[op] = {"returned": returned, "view": view, "between": parent[:, 1::2].clone()}
    return out


@pytest.fixture(scope="module")
def results2():
    with RankGroup(2, choose_placement("cpu", 2), timeout=120.0) as group:
        yield group.run(_rank_in_place_ops)


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_in_place_collective_on_strided_view(results2, op):
    """all_reduce sums and broadcast copies rank 1's values into every element of a strided
    view, in place, leaving the storage between its elements untouched (gloo alone reduces
    the wrong elements)."""
    want = _values(0) + _values(1) if op == "all_reduce" else _values(1)
    for rank, got in enumerate(results2):
        record = got[op]
        assert torch.equal(record["returned"], want), f"{op} rank {rank}: returned value wrong"
        assert torch.equal(record["view"], want), f"{op} rank {rank}: input not updated in place"
        assert bool((record["between"] == -1).all()), f"{op} rank {rank}: wrote outside the view"
