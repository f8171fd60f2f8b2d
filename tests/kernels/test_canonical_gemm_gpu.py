"""The tp_invariant mode's kernels compiled on a GPU (skipped without one), bf16 and float32:
at the TP-local shapes of qwen3.5-moe-realdims and the medium Llama for TP 1, 2, 4 and 8, a
rank's columns (any offset, not only tile boundaries) and chunks of `canonical_gemm` and its
routed-expert leaves (`fused_moe.fused_moe_leaves`) are the TP=1 launch's bit for bit, and a
CUDA graph's replay equals the eager call."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import canonical_gemm, fused_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TP_SIZES = (1, 2, 4, 8)
CHUNKS = 8
DTYPES = (torch.bfloat16, torch.float32)
# (rows, inputs) at TP 1: column-parallel rows split, row-parallel inputs split.
COLUMN_SHAPES = {"qwen35.attn_qkv": (9216, 2048), "llama.qkv": (1536, 1024),
                 "qwen35.lm_head": (248320 // 8, 2048)}
ROW_SHAPES = {"qwen35.out_proj": (2048, 4096), "llama.down": (1024, 2816),
              "qwen35.shared_down": (2048, 512)}


def _operands(rows, inputs, tokens, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=dtype, generator=gen)
    return torch.randn(tokens, inputs, **kw), torch.randn(rows, inputs, **kw) * inputs**-0.5


def _shards(size: int, tp: int):
    """(rank, the slice of `size` elements that rank holds) for each rank of TP `tp`."""
    local = size // tp
    return [(rank, slice(rank * local, (rank + 1) * local)) for rank in range(tp)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("name", COLUMN_SHAPES)
def test_columns_at_every_tp_size(name, tokens, dtype):
    rows, inputs = COLUMN_SHAPES[name]
    x, w = _operands(rows, inputs, tokens, dtype)
    whole = canonical_gemm.chunk_products(x, w, 1, dtype)[0]
    want = (x.double() @ w.double().T)
    assert float((whole.double() - want).norm() / want.norm()) < 1e-2
    for tp in TP_SIZES:
        for rank, part in _shards(rows, tp):
            got = canonical_gemm.chunk_products(x, w[part], 1, dtype)[0]
            assert torch.equal(got, whole[:, part]), f"{name} tp={tp} rank {rank}"
    # Columns that start off a tile boundary.
    assert torch.equal(canonical_gemm.chunk_products(x, w[5:], 1, dtype)[0], whole[:, 5:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("name", ROW_SHAPES)
def test_chunks_at_every_tp_size(name, tokens, dtype):
    rows, inputs = ROW_SHAPES[name]
    x, w = _operands(rows, inputs, tokens, dtype)
    whole = canonical_gemm.chunk_products(x, w, CHUNKS, torch.float32)
    for tp in TP_SIZES:
        for (rank, part), (_, chunks) in zip(_shards(inputs, tp), _shards(CHUNKS, tp)):
            got = canonical_gemm.chunk_products(x[:, part], w[:, part], CHUNKS // tp,
                                                torch.float32)
            assert torch.equal(got, whole[chunks]), f"{name} tp={tp} rank {rank}"


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_expert_leaves_at_realdims(tokens):
    """Qwen3.6-35B-A3B's experts (64 of them here, hidden 2048, intermediate 512, top 8) in
    bf16: each rank's leaves are TP=1's leaves of its chunks bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    experts, hidden, inter = 64, 2048, 512
    w13 = torch.randn(experts, 2 * inter, hidden, **kw) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, **kw) * inter**-0.5
    x = torch.randn(tokens, hidden, **kw)
    weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen),
                                 -1).topk(8)
    weights = weights.bfloat16()
    whole = fused_moe.fused_moe_leaves(x, weights, ids, w13, w2, CHUNKS)
    for tp in TP_SIZES:
        for (rank, part), (_, chunks) in zip(_shards(inter, tp), _shards(CHUNKS, tp)):
            r13 = torch.cat([w13[:, :inter][:, part], w13[:, inter:][:, part]], 1).contiguous()
            got = fused_moe.fused_moe_leaves(x, weights, ids, r13,
                                             w2[:, :, part].contiguous(), CHUNKS // tp)
            assert torch.equal(got, whole[chunks]), \
                f"tokens={tokens} tp={tp} rank {rank}"


def test_graph_replay_equals_eager():
    x, w = _operands(4096, 2048, 4, torch.bfloat16)
    eager = canonical_gemm.chunk_products(x, w, CHUNKS, torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = canonical_gemm.chunk_products(x, w, CHUNKS, torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
