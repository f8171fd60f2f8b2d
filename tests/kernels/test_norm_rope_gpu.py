"""The norm kernels (`freetoken.kernels.norm_rope`) compiled on a GPU (skipped without one),
bf16, at qwen3.5-moe-realdims' shapes for 1, 16 and 300 tokens: the decoder RMSNorm over
2048 channels (both weight forms), the per-head q norm over 16 heads of 256 inside a fused
projection's rows, and GatedDeltaNet's gated norm over 32 heads of 128, each within bf16
rounding of the torch modules (the engine's CPU path) and a CUDA graph's replay equal to
the eager call."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import assert_graph_equals_eager, rel_l2

from freetoken.kernels import norm_rope
from freetoken.layers.gated_norm import GatedRMSNorm
from freetoken.layers.norm import RMSNorm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _module(module, seed):
    gen = torch.Generator().manual_seed(seed)
    module.weight.data = (torch.randn(module.weight.shape, generator=gen) * 0.3).bfloat16()
    return module.cuda()


def _assert_close(got, want, what):
    error = rel_l2(got, want)
    assert got.shape == want.shape and error < 1e-2, f"{what}: relative L2 {error:.2e}"


@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norms_bf16(tokens, offset):
    """Rows of 2048 and per-head rows of 256 (a strided view) against RMSNorm."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    for channels, heads in ((2048, 1), (256, 16)):
        norm = _module(RMSNorm(channels, 1e-6, offset=offset), channels)
        fused = torch.randn(tokens, (heads + 2) * channels, **kw) * 3
        x = fused[:, : heads * channels].view(tokens, heads, channels).squeeze(1)
        what = f"rms_norm T={tokens} {heads}x{channels} offset={offset}"
        fn = lambda x=x, norm=norm: norm_rope.rms_norm(x, norm.weight, 1e-6, offset)  # noqa: E731
        _assert_close(fn(), norm(x), what)
        assert_graph_equals_eager(fn, what)


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gated_rms_norm_bf16(tokens):
    """32 value heads of 128 gated by a strided view of a projection, against GatedRMSNorm."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    norm = _module(GatedRMSNorm(128, 1e-6), tokens)
    x = torch.randn(tokens, 32, 128, **kw)
    z = torch.randn(tokens, 32 * 128 + 64, **kw)[:, 64:].view(tokens, 32, 128)
    fn = lambda: norm_rope.gated_rms_norm(x, z, norm.weight, 1e-6)  # noqa: E731
    _assert_close(fn(), norm(x, z), f"gated norm T={tokens}")
    assert_graph_equals_eager(fn, f"gated norm T={tokens}")
