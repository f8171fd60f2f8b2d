"""The decode-step linear kernels (`freetoken.kernels.gemv`) compiled on a GPU (skipped
without one), bf16: at the TP-local projection shapes of the medium Llama and
qwen3.5-moe-realdims for TP 1, 2, 4 and 8, each fused launch within 1e-2 relative L2 of the
torch steps it replaces, and a CUDA graph's replay equal to the eager call bit for bit."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import assert_graph_equals_eager, rel_l2

from freetoken.kernels import gemv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TP_SIZES = (1, 2, 4, 8)
# (rows at TP 1, inputs at TP 1, split: "rows" (column-parallel) or "inputs" (row-parallel),
#  fused: norm 0 / 1 / 2, gated, residual)
SHAPES = {
    "llama.qkv": (1536, 1024, "rows", 1, False, False),
    "llama.o": (1024, 1024, "inputs", 0, False, True),
    "llama.gate_up": (5632, 1024, "rows", 1, True, False),
    "llama.down": (1024, 2816, "inputs", 0, False, True),
    "qwen35.gdn_in_proj": (12352, 2048, "rows", 2, False, False),
    "qwen35.out_proj": (2048, 4096, "inputs", 0, False, True),
    "qwen35.attn_qkv": (9216, 2048, "rows", 2, False, False),
    "qwen35.router": (256, 2048, "none", 0, False, False),
    "qwen35.router+norm": (256, 2048, "none", 2, False, False),
    "qwen35.shared_gate_up": (1024, 2048, "rows", 0, True, False),
    "qwen35.shared_down": (2048, 512, "inputs", 0, False, False),
}


def _make_case(name, tp, tokens):
    rows, inputs, split, norm, gated, residual = SHAPES[name]
    rows, inputs = (rows // tp, inputs) if split == "rows" else (
        (rows, inputs // tp) if split == "inputs" else (rows, inputs))
    gen = torch.Generator(device="cuda").manual_seed(rows + inputs + tokens)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(tokens, inputs, **kw)
    weight = torch.randn(rows, inputs, **kw) * inputs**-0.5
    out = rows // 2 if gated else rows
    fused = dict(norm=gemv.Norm(torch.randn(inputs, **kw) * 0.3, 1e-6, norm == 2) if norm
                 else None, gated=gated,
                 residual=torch.randn(tokens, out, **kw) if residual else None)
    return x, weight, fused


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_projection_bf16(name, tp, tokens):
    """One projection with what the engine fuses into it, against the torch steps."""
    x, weight, fused = _make_case(name, tp, tokens)
    got = gemv.linear(x, weight, **fused)
    error = rel_l2(got, gemv.reference_linear(x, weight, **fused))
    assert error < 1e-2, f"{name} tp={tp} T={tokens}: relative L2 {error:.2e} >= 1e-2"
    assert_graph_equals_eager(lambda: gemv.linear(x, weight, **fused),
                               f"{name} tp={tp} T={tokens}")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_row_kernel_bf16(name, tp):
    """One token through the kernel without tensor cores (`rows` tiles: two features per
    program, the whole input row in one or two steps, and split over the inputs), against
    the torch steps; graph replay equal to eager."""
    x, weight, fused = _make_case(name, tp, 1)
    step = min(1024, gemv.next_pow2(x.shape[1]))
    for tiles in (gemv.GemvTiles(2, step, num_stages=2, rows=True),
                  gemv.GemvTiles(4, max(16, step // 2), num_stages=2, split=2, rows=True)):
        got = gemv.linear(x, weight, **fused, tiles=tiles)
        error = rel_l2(got, gemv.reference_linear(x, weight, **fused))
        what = f"{name} tp={tp} {tiles.key()}"
        assert error < 1e-2, f"{what}: relative L2 {error:.2e} >= 1e-2"
        assert_graph_equals_eager(lambda t=tiles: gemv.linear(x, weight, **fused, tiles=t), what)


def test_row_kernels_with_pdl_match_ordinary_launches(monkeypatch):
    """The medium Llama's one-token MLP and attention projections as a chain of row
    launches (each reads the previous one's output), with programmatic dependent launch
    (`gemv.ROW_PDL`, where the GPU has it) and without: the same bits, eagerly call after
    call and in a CUDA graph's replay. (A read before the wait would differ only when it
    loses the race; the PTX test in test_gemv.py is the guard of the order.)"""
    cases = [_make_case(name, 1, 1) for name in ("llama.qkv", "llama.o", "llama.gate_up",
                                                  "llama.down")]

    tiles = gemv.GemvTiles(2, 1024, num_stages=2, rows=True)

    def chain(x):
        for _ in range(3):
            for _, weight, fused in cases:   # qkv's first 1024 outputs feed o
                x = gemv.linear(x[:, :weight.shape[1]], weight, **fused, tiles=tiles)
        return x

    x = cases[0][0]
    monkeypatch.setattr(gemv, "ROW_PDL", False)
    want = chain(x)
    monkeypatch.setattr(gemv, "ROW_PDL", True)
    for _ in range(5):
        assert torch.equal(chain(x), want)
    assert_graph_equals_eager(lambda: chain(x), "row kernels with PDL", want, replays=5)


@pytest.mark.parametrize("tokens", [1, 16])
def test_moe_combine_bf16(tokens):
    """The MoE block's combination at realdims (hidden 2048, top 8) against torch."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", generator=gen)
    slots = torch.randn(tokens, 8, 2048, **kw)
    x = torch.randn(tokens, 2048, dtype=torch.bfloat16, **kw)
    gate_weight = torch.randn(1, 2048, dtype=torch.bfloat16, **kw) * 2048**-0.5
    shared = torch.randn(tokens, 2048, dtype=torch.bfloat16, **kw)
    got = gemv.moe_combine(slots, x, gate_weight, shared)
    error = rel_l2(got, gemv.reference_moe_combine(slots, x, gate_weight, shared))
    assert error < 1e-2, f"moe_combine T={tokens}: relative L2 {error:.2e} >= 1e-2"
    assert_graph_equals_eager(lambda: gemv.moe_combine(slots, x, gate_weight, shared),
                               f"moe_combine T={tokens}")
    # One slot in x's dtype: the rounded sum of experts that sum their own slots (NVFP4).
    routed = slots.sum(dim=1, keepdim=True).to(torch.bfloat16)
    got = gemv.moe_combine(routed, x, gate_weight, shared)
    error = rel_l2(got, gemv.reference_moe_combine(routed, x, gate_weight, shared))
    assert error < 1e-2, f"moe_combine one bf16 slot T={tokens}: relative L2 {error:.2e}"
    # ... plus the decoder layer's residual (TP 1), rounded after the block's output, as
    # `residual + block(x)`: equal to torch's steps in bf16.
    residual = torch.randn(tokens, 2048, dtype=torch.bfloat16, **kw) * 4
    got = gemv.moe_combine(routed, x, gate_weight, shared, residual=residual)
    want = residual + gemv.moe_combine(routed, x, gate_weight, shared)
    assert torch.equal(got, want), f"moe_combine with the residual T={tokens}"


@pytest.mark.parametrize("tokens", [1, 16])
def test_router_stores_the_normalised_input_bf16(tokens):
    """The MoE block's router with its RMSNorm fused also stores the normalised input for
    the experts (`normed`), from the measured tiles, the default ones and the row kernel
    (split too): the projection and the stored input against the torch steps, graph
    replay equal to eager."""
    x, weight, fused = _make_case("qwen35.router+norm", 1, tokens)
    want = gemv.reference_linear(x, weight, **fused)
    want_normed = gemv.reference_norm(x, fused["norm"])
    choices = [gemv.tiles_for(x, weight, norm=fused["norm"]),
               gemv.choose_tiles(256, 2048, x.dtype)]
    if tokens == 1:
        choices += [gemv.GemvTiles(1, 2048, num_stages=2, rows=True),
                    gemv.GemvTiles(2, 512, num_stages=2, split=2, rows=True)]
    for tiles in filter(None, choices):
        normed = torch.full_like(x, float("nan"))
        got = gemv.linear(x, weight, **fused, tiles=tiles, normed=normed)
        what = f"router+norm T={tokens} {tiles.key()}"
        assert rel_l2(got, want) < 1e-2, f"{what}: output relative L2 {rel_l2(got, want):.2e}"
        error = rel_l2(normed, want_normed)
        assert error < 1e-2, f"{what}: normalised input relative L2 {error:.2e}"
        assert_graph_equals_eager(
            lambda t=tiles, n=normed: gemv.linear(x, weight, **fused, tiles=t, normed=n), what)
