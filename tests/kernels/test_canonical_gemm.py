"""The tp_invariant mode's kernels on the CUDA path, in Triton's interpreter (float32; the
interpreter's dot does not take bf16 operands): `canonical_gemm.chunk_products` against its
float64 oracle, and a rank's chunks and columns equal to the TP=1 launch's bit for bit at the
TP-local shapes of TP 1/2/4/8; `fused_moe.fused_moe_leaves` the same for the routed experts.

The interpreter computes a tile's dot with numpy, whose result for a column can depend on
where the column sits in the tile, so the column slices here start on tile boundaries; on a
GPU an element's arithmetic does not depend on its place (tests/kernels/
test_canonical_gemm_gpu.py takes any offset there)."""

from __future__ import annotations

import pytest
import torch
from interpreted import TP_SIZES, interpreter  # noqa: F401  (module-wide fixture)

from freetoken.kernels import canonical_gemm, fused_moe

CHUNKS = 8


def _operands(rows: int, cols: int, inputs: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=gen),
            torch.randn(cols, inputs, generator=gen) * inputs**-0.5)


def test_chunk_products_match_the_float64_oracle():
    x, w = _operands(5, 70, 8 * 40)
    got = canonical_gemm.chunk_products(x, w, CHUNKS, torch.float32)
    want = canonical_gemm.reference_chunk_products(x, w, CHUNKS)
    assert got.shape == (CHUNKS, 5, 70)
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("tp", TP_SIZES)
def test_a_ranks_chunks_are_the_tp1_chunks(tp):
    """Rank r of a row-parallel GEMM holds inputs [r K/tp, (r+1) K/tp): its chunks are the
    TP=1 launch's chunks r*C/tp .. (r+1)*C/tp - 1, bit for bit (chunk length 24: partial K
    steps)."""
    x, w = _operands(3, 50, CHUNKS * 24)
    whole = canonical_gemm.chunk_products(x, w, CHUNKS, torch.float32)
    width, local = x.shape[1] // tp, CHUNKS // tp
    for rank in range(tp):
        part = slice(rank * width, (rank + 1) * width)
        got = canonical_gemm.chunk_products(x[:, part], w[:, part], local, torch.float32)
        assert torch.equal(got, whole[rank * local:(rank + 1) * local]), f"tp={tp} rank {rank}"


@pytest.mark.parametrize("tp", TP_SIZES)
def test_a_ranks_columns_are_the_tp1_columns(tp):
    block = canonical_gemm.TILES.block_n
    x, w = _operands(4, 8 * block, 96)
    whole = canonical_gemm.chunk_products(x, w, 1, torch.float32)[0]
    rows = w.shape[0] // tp
    for rank in range(tp):
        part = slice(rank * rows, (rank + 1) * rows)
        got = canonical_gemm.chunk_products(x, w[part], 1, torch.float32)[0]
        assert torch.equal(got, whole[:, part]), f"tp={tp} rank {rank}"


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(2, 8), w=torch.zeros(4, 6)), r"x \(2, 8\) and weight \(4, 6\)"),
    (dict(x=torch.zeros(2, 8), w=torch.zeros(4, 8, dtype=torch.float64)), "weight is"),
    (dict(x=torch.zeros(2, 8), w=torch.zeros(4, 8), chunks=3), "8 inputs do not split into 3"),
])
def test_chunk_products_refuse_bad_operands(bad, match):
    with pytest.raises(ValueError, match=match):
        canonical_gemm.chunk_products(bad["x"], bad["w"], bad.get("chunks", 1), torch.float32)


def _experts(hidden: int, inter: int, experts: int = 4, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w13, w2


def _routing(tokens: int, experts: int, top_k: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return weights, ids


def _rank_experts(w13: torch.Tensor, w2: torch.Tensor, tp: int, rank: int):
    inter = w2.shape[2]
    local = inter // tp
    part = slice(rank * local, (rank + 1) * local)
    gate, up = w13[:, :inter], w13[:, inter:]
    return torch.cat([gate[:, part], up[:, part]], dim=1).contiguous(), \
        w2[:, :, part].contiguous()


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_a_ranks_expert_leaves_are_the_tp1_leaves(tp, tokens):
    """Each rank's routed-expert leaves equal TP=1's leaves of its chunks bit for bit (one
    token takes the one-token layout, several the sorted one); their sum is the routed
    output within fp32 rounding."""
    hidden, inter, top_k = 64, 8 * 32, 2
    w13, w2 = _experts(hidden, inter)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))
    weights, ids = _routing(tokens, w13.shape[0], top_k)
    whole = fused_moe.fused_moe_leaves(x, weights, ids, w13, w2, CHUNKS)
    assert whole.shape == (CHUNKS, tokens, hidden)
    want = fused_moe.reference_moe(x, weights, ids, w13, w2)
    assert (whole.sum(0) - want).abs().max() < 1e-5
    local = CHUNKS // tp
    for rank in range(tp):
        r13, r2 = _rank_experts(w13, w2, tp, rank)
        got = fused_moe.fused_moe_leaves(x, weights, ids, r13, r2, local)
        assert torch.equal(got, whole[rank * local:(rank + 1) * local]), f"tp={tp} rank {rank}"


def test_expert_leaves_refuse_an_intermediate_that_does_not_split():
    w13, w2 = _experts(32, 24)
    weights, ids = _routing(1, 4, 2)
    with pytest.raises(ValueError, match="local intermediate size 24 does not split into 16"):
        fused_moe.fused_moe_leaves(torch.zeros(1, 32), weights, ids, w13, w2, 16)
