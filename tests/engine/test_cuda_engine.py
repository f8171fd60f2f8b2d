"""The engine's CUDA paths on a GPU (skipped without one): the Triton kernels in bfloat16 at
real TP-local shapes against their torch references; graph-replay decode logits equal to
eager ones bit for bit at the same batch (and a stale graph input caught); the float32 engine
on the GPU (kernels and graphs) against the CPU engine on the bundled cases."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TP_SIZES = (1, 2, 4, 8)


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_fused_moe_bf16_at_realdims(tp, tokens):
    """Qwen3.6-35B-A3B experts (256 of hidden 2048, intermediate 512 / tp, top 8) in bf16:
    within 1e-2 relative L2 of the torch loop (both round h to bf16)."""
    from freetoken.kernels.fused_moe import fused_moe, reference_moe

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    inter = 512 // tp
    w13 = torch.randn(256, 2 * inter, 2048, **kw) * 2048**-0.5
    w2 = torch.randn(256, 2048, inter, **kw) * inter**-0.5
    x = torch.randn(tokens, 2048, **kw)
    weights, ids = torch.softmax(torch.randn(tokens, 256, device="cuda", generator=gen),
                                 -1).topk(8)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    err = _rel_l2(fused_moe(x, weights, ids, w13, w2), reference_moe(x, weights, ids, w13, w2))
    assert err < 1e-2, f"tp={tp} tokens={tokens}: relative L2 {err:.2e}"


@pytest.mark.parametrize("pairs, experts, block_m", [(2, 256, 16), (16, 256, 16),
                                                     (128, 256, 16), (1000, 256, 16),
                                                     (1024, 256, 64), (333, 8, 16),
                                                     (1000, 1, 64)])
def test_one_launch_alignment_equals_torch_alignment(pairs, experts, block_m):
    """The compiled one-launch expert alignment (one program per expert, a histogram each)
    gives exactly the torch alignment's rows and block experts for batches of the real
    expert count up to the largest it takes, and for the dense NVFP4 linear's single
    expert (its prefill rows)."""
    from freetoken.kernels.moe_align import align_by_expert, align_small

    gen = torch.Generator(device="cuda").manual_seed(pairs)
    ids = torch.randint(0, experts, (pairs,), device="cuda", generator=gen)
    got, want = align_small(ids, experts, block_m), align_by_expert(ids, experts, block_m)
    assert torch.equal(got[0], want[0]), "rows differ"
    assert torch.equal(got[1], want[1]), "block experts differ"


# (heads, kv heads, head dim): medium Llama and qwen3.5-moe-realdims full attention.
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("shape", [(16, 4, 64), (16, 2, 256)])
def test_paged_attention_bf16(tp, shape):
    """bf16 decode and prefill within 1e-2 relative L2 of the torch path."""
    from freetoken.kernels.paged_attention import (
        paged_attention,
        prefill_work,
        reference_paged_attention,
        rows_per_program,
    )
    from freetoken.layers.linear import local_kv_heads

    heads, kv, dim = shape[0] // tp, local_kv_heads(shape[1], tp), shape[2]
    block_size, lens = 16, [300, 17, 64]
    kw = dict(device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(64, block_size, kv, dim, **kw) for _ in range(2))
    tables = [list(range(0, 19)), list(range(19, 21)), list(range(21, 25))]
    padded = torch.tensor([t + [0] * (19 - len(t)) for t in tables], dtype=torch.int32,
                          device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for qlens in ([1, 1, 1], lens):
        q = torch.randn(sum(qlens), heads, dim, **kw)
        starts = torch.tensor([0, *qlens], device="cuda").cumsum(0).to(torch.int32)
        work = None
        if qlens == lens:
            per = rows_per_program(heads, kv, dim, False) // (heads // kv)
            work = prefill_work(qlens, per, "cuda")
        got = paged_attention(q, k_cache, v_cache, padded, starts, ctx, dim**-0.5, work)
        want = reference_paged_attention(q.cpu().float(), k_cache.cpu().float(),
                                         v_cache.cpu().float(), tables, qlens, lens, dim**-0.5)
        err = _rel_l2(got.cpu(), want)
        assert err < 1e-2, f"tp={tp} {shape} qlens={qlens}: relative L2 {err:.2e}"


def _decode_logits(llm, prompts):
    params = SamplingParams(max_tokens=5, ignore_eos=True, return_logits=True)
    return [r.logits for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3.5-moe"])
def test_graph_replay_equals_eager_bitwise(case):
    """bf16, batches of 1, 2 and 4 (each fills its bucket): every decode step's logits from
    graph replay equal the eager step's bit for bit."""
    prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
    prompts = (prompts * 4)[:4]
    options = dict(device="cuda", dtype="bfloat16", progress=False)
    with LLM(GOLDEN / case, **options) as graphed, \
            LLM(GOLDEN / case, enforce_eager=True, **options) as eager:
        assert graphed._core.graphs is not None and eager._core.graphs is None
        for n in (1, 2, 4):
            for i, (g, e) in enumerate(zip(_decode_logits(graphed, prompts[:n]),
                                           _decode_logits(eager, prompts[:n]))):
                assert torch.equal(g, e), (f"{case} batch {n} seq {i}: graph and eager "
                                           f"logits differ by {(g - e).abs().max():.3e}")
        assert sorted(graphed._core.graphs.graphs) == [1, 2, 4]


def test_stale_graph_input_is_caught():
    """A graph runner that stops updating positions after capture (a stale static input)
    gives decode logits unequal to eager: the bitwise comparison above can fail."""
    prompts = json.loads((GOLDEN / "tiny-llama" / "meta.json").read_text())["prompts"][:2]
    options = dict(device="cuda", dtype="bfloat16", progress=False)
    with LLM(GOLDEN / "tiny-llama", **options) as graphed, \
            LLM(GOLDEN / "tiny-llama", enforce_eager=True, **options) as eager:
        graphs = graphed._core.graphs
        fill = graphs._fill

        def stale_fill(bucket, *rows):
            kept = graphs.staging[:, 1].clone()
            fill(bucket, *rows)
            if bucket in graphs.graphs:
                graphs.staging[:, 1].copy_(kept)

        graphs._fill = stale_fill
        got, want = _decode_logits(graphed, prompts), _decode_logits(eager, prompts)
    assert any(not torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3-moe", "tiny-qwen3.5-moe",
                                  "tiny-qwen3.5-moe-nvfp4"])
def test_float32_gpu_engine_matches_cpu_engine(case):
    """float32 on the GPU (Triton paths, decode graphs) against the CPU engine: prompt and
    decode logits within 1e-4, the same greedy tokens."""
    prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, return_logits=True,
                            return_prompt_logits=True)
    results = {}
    for device in ("cpu", "cuda"):
        with LLM(GOLDEN / case, device=device, dtype="float32", progress=False) as llm:
            results[device] = llm.generate(prompts, params)
    for i, (c, g) in enumerate(zip(results["cpu"], results["cuda"])):
        for name in ("prompt_logits", "logits"):
            torch.testing.assert_close(getattr(g, name), getattr(c, name), rtol=1e-4,
                                       atol=1e-4, msg=lambda m, n=name, i=i: f"{case} {i} {n}: {m}")
        assert g.token_ids == c.token_ids, f"{case} prompt {i}: {g.token_ids} != {c.token_ids}"


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3.5-moe"])
def test_overlapped_graph_steps_equal_stepwise(case):
    """bf16 with decode graphs: overlapped steps (the default there: each step launched
    before the previous one's tokens reach the host, ids fed back inside the graph) give the
    tokens and finish reasons of steps run one at a time, with an end token stopping one
    sequence mid-batch and uneven length limits."""
    prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
    prompts = (prompts * 4)[:4]
    options = dict(device="cuda", dtype="bfloat16", progress=False)
    with LLM(GOLDEN / case, **options) as overlapped, \
            LLM(GOLDEN / case, overlap_steps=False, **options) as stepwise:
        assert overlapped._core.overlap and not stepwise._core.overlap
        params = [SamplingParams(max_tokens=6 + i, ignore_eos=True) for i in range(4)]
        want = [r.token_ids for r in stepwise.generate(prompts, params)]
        assert [r.token_ids for r in overlapped.generate(prompts, params)] == want
        eos = want[1][3]   # the second sequence's fourth token ends it
        for core in (overlapped._core, stepwise._core):
            core.model_config = dataclasses.replace(core.model_config, eos_token_ids=(eos,))
        params = [SamplingParams(max_tokens=8, ignore_eos=i != 1) for i in range(4)]
        got = [(r.token_ids, r.finish_reason) for r in overlapped.generate(prompts, params)]
        want = [(r.token_ids, r.finish_reason) for r in stepwise.generate(prompts, params)]
    assert want[1][1] == "stop" and got == want, f"{case}: {got} != {want}"
