"""`Communicator.all_reduce_tree`, the tp_invariant mode's all-reduce: on every rank the same
bits as `tree_sum` of all ranks' tensors in rank order, in the tensor's own dtype, and the
input left as it was."""

from __future__ import annotations

import torch

from freetoken.distributed import RankGroup, choose_placement, get_communicator
from freetoken.distributed.comm import Communicator, tree_sum

SIZE = 4


def _make_part(rank: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    # Magnitudes spread over 2^-10 .. 2^10, so the summation order shows in the bits.
    return (torch.randn(3, 257, generator=gen) * 2.0 ** torch.randint(
        -10, 11, (3, 257), generator=gen)).to(dtype)


def _rank_tree(ctx, dtype: torch.dtype):
    part = _make_part(ctx.rank, dtype)
    before = part.clone()
    reduced = get_communicator().all_reduce_tree(part)
    return reduced, torch.equal(part, before)


def test_all_reduce_tree_is_tree_sum_on_every_rank():
    """Four gloo ranks: every rank's result equals `tree_sum` of the four parts in rank order,
    bit for bit, in fp32 and bf16, and the input tensor is untouched; with one rank the call
    is the identity."""
    parts = {d: [_make_part(r, d) for r in range(SIZE)] for d in (torch.float32, torch.bfloat16)}
    group = RankGroup(SIZE, choose_placement("cpu", SIZE), timeout=120.0)
    group.start()
    try:
        for dtype, ranks_parts in parts.items():
            want = tree_sum(list(ranks_parts))
            for rank, (got, untouched) in enumerate(group.run(_rank_tree, dtype)):
                assert got.dtype == dtype, f"{dtype} rank {rank}: result dtype {got.dtype}"
                assert torch.equal(got, want), f"{dtype} rank {rank}: differs from tree_sum"
                assert untouched, f"{dtype} rank {rank}: the input was modified"
    finally:
        group.close()
    single = parts[torch.float32][0]
    assert Communicator(1).all_reduce_tree(single) is single, "size 1: not the identity"
