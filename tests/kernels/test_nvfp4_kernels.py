"""NVFP4 Triton kernels in Triton's interpreter, float32 activations (the interpreter computes
bf16 arithmetic wrongly; bf16 is checked on GPU by bench/gpu_kernels_check.py): both MoE paths
and the dense linear agree with the torch reference, the expert alignment places every pair
exactly once, and the layers' triton backend matches their torch backend."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.quantization.nvfp4.format import NVFP4FormatError
from freetoken.layers.quantization.nvfp4.quantizer import quantize
from freetoken.layers.quantization.nvfp4.reference import reference_moe
from verify.checks.kernels import make_experts


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Kernels in this process run interpreted (sets TRITON_INTERPRET=1 for the process)."""
    from freetoken.kernels import use_interpreter

    use_interpreter()


def _make_routing(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, weights, ids


def _assert_close(got, want, what):
    atol = 1e-5 * max(float(want.abs().max()), 1e-30)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [
    (3, 6, 2, 48, 16),     # H = 3 groups (tile masking), I_local = one group
    (20, 8, 3, 64, 64),
])
def test_both_moe_paths_match_reference(tokens, experts, top_k, hidden, inter):
    """decode and prefill paths give the reference's routed-expert sum."""
    from freetoken.kernels import nvfp4_moe

    w = make_experts(experts, hidden, inter, 1, seed=tokens)
    x, weights, ids = _make_routing(tokens, experts, top_k, hidden, seed=tokens)
    want = reference_moe(x, weights, ids, **w)
    for path in ("decode", "prefill"):
        _assert_close(nvfp4_moe.fused_moe(x, weights, ids, **w, path=path), want, path)
    assert nvfp4_moe.fused_moe(x[:0], weights[:0], ids[:0], **w).shape == (0, hidden)


def test_decode_split_k_matches_reference():
    """With tiles that force gate_up to split K into several programs (partials summed by
    `silu_mul_splits`), the decode path still gives the reference's sum, and so does the
    dense linear."""
    from freetoken.kernels import nvfp4_linear, nvfp4_moe
    from freetoken.layers.quantization.nvfp4.reference import reference_linear

    tiles = nvfp4_moe.Tiles(decode_n=16, decode_kb=8, few_kb=8, decode_programs=10**6)
    w = make_experts(4, 80, 32, 1, seed=5)      # 40 packed bytes: splits of 3 and 2 steps
    x, weights, ids = _make_routing(2, 4, 2, 80, seed=5)
    want = reference_moe(x, weights, ids, **w)
    _assert_close(nvfp4_moe.fused_moe(x, weights, ids, **w, path="decode", tiles=tiles), want,
                  "split decode")
    q = quantize(torch.randn(24, 80, generator=torch.Generator().manual_seed(6)))
    lin = dict(packed=q.packed, block_scale=q.block_scale, global_scale=q.global_scale)
    _assert_close(nvfp4_linear.nvfp4_linear(x, **lin, path="decode", tiles=tiles),
                  reference_linear(x, **lin), "split linear")


def test_decode_adds_a_token_routed_twice_to_one_expert():
    """ids that repeat an expert within a token (not what top-k gives, but fused_moe takes any
    ids) count once per slot, with each slot's weight, on both paths."""
    from freetoken.kernels import nvfp4_moe

    w = make_experts(4, 48, 32, 1, seed=7)
    x, weights, _ = _make_routing(3, 4, 3, 48, seed=7)
    ids = torch.tensor([[1, 1, 2], [0, 3, 0], [2, 2, 2]])
    want = reference_moe(x, weights, ids, **w)
    for path in ("decode", "prefill"):
        _assert_close(nvfp4_moe.fused_moe(x, weights, ids, **w, path=path), want, path)


def test_ptx_lookup_tables_hold_the_e2m1_magnitudes():
    """The prmt tables of the GPU dequantization (which the interpreter cannot run) give
    byte-exact bf16 and fp16 for every e2m1 magnitude code."""
    from freetoken.kernels import nvfp4_jit
    from freetoken.layers.quantization.nvfp4.format import E2M1_VALUES

    def table(words, code):
        return (words[code // 4] >> (8 * (code % 4))) & 0xFF

    for code in range(8):
        want = float(E2M1_VALUES[code])
        bf16 = table(nvfp4_jit.BF16_HIGH, code) << 8 | table(nvfp4_jit.BF16_LOW, code)
        fp16 = table(nvfp4_jit.FP16_HIGH, code) << 8
        for bits, dtype in ((bf16, torch.bfloat16), (fp16, torch.float16)):
            got = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dtype).item()
            assert got == want, f"code {code}: {dtype} table gives {got}, want {want}"


def test_align_by_expert_places_every_pair_once():
    """Sorted rows hold each pair exactly once, every used block holds one expert's pairs
    only, padding rows hold the sentinel, unused blocks are -1."""
    from freetoken.kernels.nvfp4_moe import align_by_expert

    ids = torch.tensor([3, 0, 3, 3, 1, 0, 3, 3, 3, 3, 3])
    rows, blocks = align_by_expert(ids, num_experts=5, block_m=4)
    n = ids.numel()
    real = rows[rows < n]
    assert sorted(real.tolist()) == list(range(n))
    assert rows.numel() == blocks.numel() * 4
    for b, e in enumerate(blocks.tolist()):
        chunk = rows[4 * b: 4 * (b + 1)]
        chunk = chunk[chunk < n]
        if e < 0:
            assert chunk.numel() == 0, f"unused block {b} holds pairs"
        else:
            assert bool((ids[chunk.long()] == e).all()), f"block {b} mixes experts"
    assert blocks.tolist()[:4] == [0, 1, 3, 3] and set(blocks.tolist()[4:]) == {-1}


def test_fused_moe_names_the_mis_shaped_tensor():
    """A w2 scale with the wrong column count is named, with the sizes it implies."""
    from freetoken.kernels import nvfp4_moe

    w = make_experts(2, 32, 32, 1, seed=0)
    w["w2_scale"] = w["w2_scale"][:, :, :1]
    x, weights, ids = _make_routing(2, 2, 1, 32, seed=0)
    with pytest.raises(NVFP4FormatError, match=r"w2_scale has shape \(2, 32, 1\).*\(2, 32, 2\)"):
        nvfp4_moe.fused_moe(x, weights, ids, **w)


def test_layers_triton_backend_matches_torch_backend():
    """NVFP4FusedExperts and NVFP4Linear give the same output on either backend."""
    from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts, NVFP4Linear

    w = make_experts(4, 64, 32, 1, seed=3)
    layers = {b: NVFP4FusedExperts(4, 64, 32, backend=b) for b in ("torch", "triton")}
    for layer in layers.values():
        for name, src in (("w13_weight", "w13"), ("w13_weight_scale", "w13_scale"),
                          ("w13_weight_scale_2", "w13_global"), ("w2_weight", "w2"),
                          ("w2_weight_scale", "w2_scale"), ("w2_weight_scale_2", "w2_global")):
            getattr(layer, name).data.copy_(w[src])
    x, weights, ids = _make_routing(9, 4, 2, 64, seed=3)
    _assert_close(layers["triton"](x, weights, ids), layers["torch"](x, weights, ids), "moe")
    q = quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(4)))
    linears = {b: NVFP4Linear(64, 32, backend=b, bias=True) for b in ("torch", "triton")}
    for layer in linears.values():
        layer.weight.data.copy_(q.packed)
        layer.weight_scale.data.copy_(q.block_scale)
        layer.weight_scale_2.data.copy_(q.global_scale)
        layer.bias.data.copy_(torch.arange(32.0))
    _assert_close(linears["triton"](x), linears["torch"](x), "linear")
