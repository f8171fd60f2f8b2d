"""The engine's CUDA fast paths (`freetoken.kernels.fused_moe`, `freetoken.kernels.
paged_attention`) in Triton's interpreter with float32 inputs, against the torch paths the
engine runs on CPU, at the TP-local shapes of TP 1, 2, 4 and 8 (heads, KV heads and expert
intermediate size divided as the engine divides them). bf16 is checked on a GPU
(`tests/engine/test_cuda_engine.py`)."""

from __future__ import annotations

import pytest
import torch
from interpreted import TP_SIZES, interpreter  # noqa: F401  (module-wide fixture)
from interpreted import assert_close as _assert_close

from freetoken.layers.linear import local_kv_heads


def _make_experts(experts: int, hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w13, w2


def _make_routing(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=gen), -1).topk(top_k)
    return x, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_moe_matches_reference(tp, tokens):
    """The grouped kernels give the per-expert loop's sum, with the decode tiles and with
    the prefill tiles (an intermediate size of 64 / tp, down to 8 inside a 16-wide step)."""
    from freetoken.kernels.fused_moe import PREFILL_TILES, fused_moe, reference_moe

    w13, w2 = _make_experts(8, 48, 64 // tp, seed=tp)
    x, weights, ids = _make_routing(tokens, 8, 3, 48, seed=tokens)
    want = reference_moe(x, weights, ids, w13, w2)
    _assert_close(fused_moe(x, weights, ids, w13, w2), want, f"tp={tp} tokens={tokens}")
    _assert_close(fused_moe(x, weights, ids, w13, w2, tiles=PREFILL_TILES), want,
                  f"tp={tp} tokens={tokens} prefill tiles")


def test_fused_moe_fails_on_a_wrong_expert_offset():
    """A kernel that reads expert e + 1's weights (an expert stride one expert off) differs
    from the reference: the comparison above can fail."""
    from freetoken.kernels.fused_moe import fused_moe, reference_moe

    w13, w2 = _make_experts(8, 48, 32, seed=0)
    x, weights, ids = _make_routing(5, 8, 3, 48, seed=1)
    shifted = torch.cat([w13[1:], w13[:1]])
    got = fused_moe(x, weights, ids, shifted, w2)
    assert not torch.allclose(got, reference_moe(x, weights, ids, w13, w2), atol=1e-3)


def _make_cache(num_blocks, block_size, kv_heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _tables(context_lens, block_size, num_blocks, seed):
    """Each sequence's blocks, drawn without repeats from a shuffled pool."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for clen in context_lens:
        need = -(-clen // block_size)
        tables.append([pool.pop() for _ in range(need)])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return tables, padded


def _run_attention(heads, kv_heads, head_dim, query_lens, context_lens, decode, seed=0,
                   table_fault=None):
    from freetoken.kernels.paged_attention import (
        paged_attention,
        prefill_work,
        reference_paged_attention,
        rows_per_program,
    )

    block_size, num_blocks = 4, 64
    k_cache, v_cache = _make_cache(num_blocks, block_size, kv_heads, head_dim, seed)
    tables, padded = _tables(context_lens, block_size, num_blocks, seed)
    q = torch.randn(sum(query_lens), heads, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1))
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    work = None
    if not decode:
        per = rows_per_program(heads, kv_heads, head_dim, False) // (heads // kv_heads)
        work = prefill_work(query_lens, per, "cpu")
    got = paged_attention(q, k_cache, v_cache, table_fault(padded) if table_fault else padded,
                          starts, torch.tensor(context_lens, dtype=torch.int32),
                          head_dim**-0.5, work)
    want = reference_paged_attention(q, k_cache, v_cache, tables, query_lens, context_lens,
                                     head_dim**-0.5)
    return got, want


# Heads and KV heads of the bundled Llama (8 / 2) and of qwen3.5-moe-realdims (16 / 2).
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("total_heads, total_kv, head_dim", [(8, 2, 16), (16, 2, 32)])
def test_paged_attention_matches_reference(tp, total_heads, total_kv, head_dim):
    """Decode (contexts of 1, 9 and 21 positions over 4-slot blocks) and prefill (a fresh
    prompt, a prompt continued from a cached prefix, one across several programs) give the
    torch path's attention, GQA groups included."""
    heads, kv_heads = total_heads // tp, local_kv_heads(total_kv, tp)
    label = f"tp={tp} heads={heads} kv={kv_heads}"
    got, want = _run_attention(heads, kv_heads, head_dim, [1, 1, 1], [1, 9, 21], True)
    _assert_close(got, want, f"decode {label}")
    got, want = _run_attention(heads, kv_heads, head_dim, [7, 3, 37], [7, 10, 37], False)
    _assert_close(got, want, f"prefill {label}")


def test_paged_attention_fails_on_a_wrong_block_table():
    """Block tables read one block off (a wrong table stride) give a different result."""
    got, want = _run_attention(8, 2, 16, [1, 1], [9, 21], True,
                               table_fault=lambda t: t.roll(1, dims=1))
    assert not torch.allclose(got, want, atol=1e-3)


SPLIT = dict(splits=4, split_min=16, block_n=16, stages=2, seq_row=True, v_early=True)
"""A split decode (`DecodeLaunch`) that splits the contexts below over 1, 3, 3 and 4
programs."""


def test_split_decode_matches_reference_and_its_batch(monkeypatch):
    """Decode with the context split over programs and merged by the last to finish: the
    torch path's attention; a sequence gets the same bits alone as in its batch; the
    counters are left at zero."""
    from freetoken.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "DECODE", pa.DecodeLaunch(**SPLIT))
    contexts = [1, 40, 90, 100]
    got, want = _run_attention(8, 2, 16, [1] * 4, contexts, True)
    _assert_close(got, want, "split decode")
    assert not (pa._COUNTERS[torch.device("cpu")][-1]).any()
    k_cache, v_cache = _make_cache(64, 4, 2, 16, 0)
    tables, padded = _tables(contexts, 4, 64, 0)
    q = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(9))
    lens = torch.tensor(contexts, dtype=torch.int32)
    batch = pa.paged_attention(q, k_cache, v_cache, padded, torch.arange(5, dtype=torch.int32),
                               lens, 0.25)
    one = pa.paged_attention(q[3:], k_cache, v_cache, padded[3:],
                             torch.arange(2, dtype=torch.int32), lens[3:], 0.25)
    assert torch.equal(batch[3:], one)


def test_split_decode_fails_on_a_merge_before_every_split(monkeypatch):
    """A counter that does not start at zero (a launch that left it set) merges before the
    last split is written: the output differs from the torch path's and the counter is
    left set."""
    from freetoken.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "DECODE", pa.DecodeLaunch(**SPLIT))
    _run_attention(8, 2, 16, [1], [100], True)   # the counters exist
    counters = pa._COUNTERS[torch.device("cpu")][-1]
    counters[0] = 1
    got, want = _run_attention(8, 2, 16, [1], [100], True)
    assert not torch.allclose(got, want, atol=1e-3)
    assert counters.any()
    counters.zero_()


@pytest.mark.parametrize("pairs, experts, block_m", [(1, 8, 16), (24, 8, 16), (7, 3, 16),
                                                     (130, 256, 16), (300, 64, 4),
                                                     (1024, 32, 16), (600, 1, 64)])
def test_align_small_equals_torch_alignment(pairs, experts, block_m):
    """The one-launch alignment gives exactly the torch alignment's rows and block experts
    (fewer experts than histogram bins, experts hit many times and not at all, runs of
    several blocks, the unused tail of the upper-bound grid, a decode batch's largest, one
    expert: the dense NVFP4 linear's prefill rows)."""
    from freetoken.kernels.moe_align import align_by_expert, align_small

    ids = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(pairs))
    got, want = align_small(ids, experts, block_m), align_by_expert(ids, experts, block_m)
    assert torch.equal(got[0], want[0]), f"rows differ: {got[0].tolist()} != {want[0].tolist()}"
    assert torch.equal(got[1], want[1]), f"block experts {got[1].tolist()} != {want[1].tolist()}"


@pytest.mark.parametrize("top_k, renormalize", [(8, True), (3, False), (2, True)])
def test_route_matches_torch_routing(top_k, renormalize):
    """Softmax, top-k and renormalisation in one launch: the torch routing's weights and
    expert ids over 256 experts (and 12, fewer than a 16-wide block)."""
    from freetoken.kernels.fused_moe import route as kernel_route
    from freetoken.layers.moe import route

    for experts in (256, 12):
        logits = torch.randn(9, experts, generator=torch.Generator().manual_seed(experts))
        want_w, want_ids = route(logits, top_k, renormalize, torch.float32)
        got_w, got_ids = kernel_route(logits, top_k, renormalize, torch.float32)
        assert torch.equal(got_ids, want_ids), f"experts={experts}: ids differ"
        _assert_close(got_w, want_w, f"experts={experts} weights")


def test_route_breaks_ties_by_the_lowest_expert():
    """Equal probabilities are taken lowest expert first (torch.topk leaves their order to
    the implementation, so the reference here is a stable descending sort), and experts whose
    probability underflows to zero are chosen after every positive one; a top_k above the
    experts is refused."""
    from freetoken.kernels.fused_moe import route as kernel_route

    logits = torch.zeros(4, 64)
    logits[0, [5, 9, 40, 41]] = 3.0                   # four equal leaders
    logits[1] = torch.arange(64).remainder(3).float()  # many ties at each of three values
    logits[2, :] = -200.0                               # all but two underflow to zero
    logits[2, [17, 50]] = 0.0
    logits[3, ::2] = 1.0
    probs = torch.softmax(logits, dim=-1)
    assert (probs[2] == 0).sum() == 62
    for top_k, renormalize in ((8, True), (3, False)):
        want_w, want_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        want_w, want_ids = want_w[:, :top_k], want_ids[:, :top_k]
        if renormalize:
            want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        got_w, got_ids = kernel_route(logits, top_k, renormalize, torch.float32)
        assert torch.equal(got_ids, want_ids), f"top_k={top_k}: {got_ids} != {want_ids}"
        _assert_close(got_w, want_w, f"top_k={top_k} weights")
    with pytest.raises(ValueError, match="top_k 9 of 8 experts"):
        kernel_route(torch.zeros(1, 8), 9, True, torch.float32)


def test_one_token_layout_computes_the_sorted_layouts_sum():
    """A single token's pairs on the grouped kernels (named tiles; without them one token
    takes the row kernels), one block each in slot order, give the same routed sum as the
    sorted layout (its experts are distinct), at TP-local intermediate sizes."""
    from freetoken.kernels.fused_moe import DECODE_TILES, fused_moe, reference_moe

    for tp in TP_SIZES:
        w13, w2 = _make_experts(16, 48, 64 // tp, seed=tp)
        x, weights, ids = _make_routing(1, 16, 4, 48, seed=tp)
        _assert_close(fused_moe(x, weights, ids, w13, w2, tiles=DECODE_TILES),
                      reference_moe(x, weights, ids, w13, w2), f"tp={tp}")
