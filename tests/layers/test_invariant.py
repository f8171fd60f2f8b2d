"""The canonical reductions of `freetoken.layers.invariant`, against the CPU behaviour that
makes them necessary: torch's matmul result for one output element changes with the number of
output columns in the launch and with where the operands start in memory, and its exp keeps
a scalar tail loop that rounds differently; the canonical forms give one element's bits
whatever the TP size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import GOLDEN

from freetoken.distributed.comm import tree_sum
from freetoken.layers import invariant
from freetoken.models.registry import canonical_chunks, invariant_reductions, load_config

DTYPES = [torch.float32, torch.bfloat16]


def _make(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _rank_rows(rows: int, tp: int, rank: int) -> slice:
    return slice(rank * rows // tp, (rank + 1) * rows // tp)


def _assert_bits(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert torch.equal(got, want), f"{label}: {int((got != want).sum())} / {got.numel()} differ"


def test_cpu_matmul_depends_on_the_launch_shape():
    """The premise of the column tiles: some column block of `x W^T` computed alone differs
    from the same columns of the full product (fp32, a 64-wide reduction)."""
    x, w = _make(5, 64), _make(16, 64, seed=1)
    full = F.linear(x, w)
    blocks = [slice(r * 2, r * 2 + 2) for r in range(8)]
    assert not all(torch.equal(F.linear(x, w[b].clone()), full[:, b]) for b in blocks), \
        "column blocks reproduced the full product"


def test_cpu_matmul_depends_on_operand_alignment():
    """The premise of `fresh`: on some CPUs (MKL on an AMD EPYC) the same fp32 product from
    operands that start 4 bytes off the allocator's alignment gives other bits for some
    shape. Others (MKL on an Intel Xeon with AVX-512) keep the bits: `fresh` then guards
    against nothing, and the test says so by skipping."""
    def shifted(t: torch.Tensor, offset: int) -> torch.Tensor:
        store = torch.empty(t.numel() + offset, dtype=t.dtype)
        store[offset:] = t.flatten()
        return store[offset:].view(t.shape)

    moved = [(F.linear(shifted(x, off), shifted(w, off)), F.linear(x, w))
             for k in (16, 64, 100, 192, 1024) for m in (1, 3, 17)
             for x, w in [(_make(m, k), _make(64, k, seed=2))] for off in range(1, 16)]
    if all(torch.equal(a, b) for a, b in moved):
        pytest.skip("this CPU's fp32 GEMM gives the same bits from unaligned operands")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_column_linear_rows_do_not_depend_on_tp(dtype, tokens):
    """Every rank's slice of the rows (vocab-parallel: 304 padded rows at 2..16 ranks,
    starting anywhere) gives the bits of the same rows of the TP=1 result."""
    x, w, b = _make(tokens, 96, dtype=dtype), _make(304, 96, dtype=dtype, seed=3), None
    want = invariant.column_linear(x, w, b)
    for tp in (2, 4, 8, 16):
        for rank in range(tp):
            rows = _rank_rows(304, tp, rank)
            _assert_bits(invariant.column_linear(x, w[rows], b), want[:, rows],
                         f"{dtype} tokens={tokens} tp={tp} rank={rank}")


def _tp_row_linear(x: torch.Tensor, w: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """A row-parallel GEMM at `tp` simulated rank by rank: each rank's leaves and subtree,
    then the subtrees in rank order through the tree (what `all_reduce_tree` does)."""
    subtrees = []
    for rank in range(tp):
        cols = _rank_rows(w.shape[1], tp, rank)
        leaves = invariant.chunk_leaves(x[:, cols], w[:, cols], chunks // tp)
        subtrees.append(tree_sum(list(leaves.unbind(0))))
    return tree_sum(subtrees).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_parallel_tree_does_not_depend_on_tp(dtype):
    """A row-parallel GEMM cut into 8 canonical chunks gives the same bits at TP 1, 2, 4, 8,
    while a plain per-rank matmul and sum in rank order does not (fp32 here)."""
    x, w = _make(7, 256, dtype=dtype), _make(64, 256, dtype=dtype, seed=4)
    want = _tp_row_linear(x, w, 8, 1)
    for tp in (2, 4, 8):
        _assert_bits(_tp_row_linear(x, w, 8, tp), want, f"{dtype} tp={tp}")
    if dtype == torch.float32:
        plain = [sum(F.linear(x[:, _rank_rows(256, tp, r)], w[:, _rank_rows(256, tp, r)])
                     for r in range(tp)) for tp in (1, 2, 4, 8)]
        assert any(not torch.equal(p, plain[0]) for p in plain[1:]), \
            "plain partial sums agreed at every TP size"


@pytest.mark.parametrize("name, fn, dtype", [
    ("silu", F.silu, torch.float32), ("sigmoid", torch.sigmoid, torch.float32),
    ("softplus", F.softplus, torch.float32),
    ("rsqrt", lambda t: torch.rsqrt(t.abs() + 0.1), torch.bfloat16)])
def test_pointwise_has_no_length_dependent_tail(name, fn, dtype):
    """With torch's vector kernels, `fn` over the first n elements differs from the same
    elements of a longer launch for some n (the scalar tail loop); through `pointwise` it
    never does, whatever the kernels. Under ATEN_CPU_CAPABILITY=default every element takes
    the scalar loop, so the plain op has no tail to differ in."""
    x = _make(4096, dtype=dtype, seed=5)
    full, canonical = fn(x), invariant.pointwise(fn, x)
    lengths = range(1, 200)
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert any(not torch.equal(fn(x[:n].clone()), full[:n]) for n in lengths), \
            f"{name} never differed between launch lengths"
    for n in lengths:
        _assert_bits(invariant.pointwise(fn, x[:n]), canonical[:n], f"{name} n={n}")


def test_tree_sum_needs_a_power_of_two():
    """A non-power-of-two part count is refused with its count named."""
    with pytest.raises(ValueError, match="got 3"):
        tree_sum([torch.zeros(2)] * 3)


@pytest.mark.parametrize("case, chunks", [("tiny-llama", 8), ("tiny-qwen3-moe", 8),
                                          ("tiny-qwen3.5-moe", 8),
                                          ("tiny-qwen3.5-moe-nvfp4", 8)])
def test_canonical_chunks_is_the_largest_power_of_two_tp(case, chunks):
    """The chunk count of each bundled case is its largest power-of-two TP size (8 attention
    heads); a TP size the model cannot split, or one that does not divide the chunk count,
    is refused, naming tp_size."""
    cfg = load_config(GOLDEN / case)
    assert canonical_chunks(cfg) == chunks, f"{case}: chunk count"
    assert invariant_reductions(cfg, 4).local_chunks == chunks // 4, f"{case}: local chunks"
    with pytest.raises(ValueError, match="tp_size=16"):
        invariant_reductions(cfg, 16)
    with pytest.raises(ValueError, match="tp_size=3 does not divide the model's 8 canonical"):
        invariant.CanonicalReductions(chunks, 3)
