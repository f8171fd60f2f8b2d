"""The tensor-core NVFP4 decode kernels (`freetoken.kernels.nvfp4_mma_jit`) on a CPU: their inline
PTX executed for a whole warp by `ptx_emulator` (decode, scales, the activations paired as
the mma's fragments) against the reference dequantization, the kernels in Triton's
interpreter with the mma emulated, and the launcher's shape rule. The compiled kernels run on
GPUs only (compiled for sm_90 by test_nvfp4_kernels; checked in bf16 by
bench/gpu_kernels_check.py)."""

from __future__ import annotations

import numpy as np
import ptx_emulator
import pytest
import torch

from freetoken.formats.nvfp4.format import E2M1_VALUES
from freetoken.layers.quantization.nvfp4.reference import reference_moe
from freetoken_verify.checks.kernels.check import make_experts


def _e2m1(code: int) -> float:
    return float(E2M1_VALUES[code & 7]) * (-1.0 if code & 8 else 1.0)


def _f16_pair(lo: float, hi: float) -> int:
    return int(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_mma_ptx_decodes_scales_and_multiplies_a_warps_fragments(v, bf16):
    """A lane's v word positions of a chunk: lane (g, t) holds words t v .. t v + v - 1 of rows
    g and g + 8 (8 inputs each), the scale bytes of the groups they span, and for column
    n = g the activations of the same inputs, in input order. The emulated PTX gives
    every lane the D entries (rows g, g + 8; columns 2t, 2t + 1) of C + W X^T with
    W = e2m1 * e4m3 * 2^-7 (fp16 operands) or e2m1 * e4m3 * 2^-26 (bf16 operands, down on
    gate_up's bf16 h), for every nibble value and scales including zero, subnormals and 448
    (up to float32 rounding of the sums), the word positions chained in one accumulator."""
    from freetoken.kernels import nvfp4_ptx

    _check_mma_ptx(nvfp4_ptx.mma_asm(v, bf16=bf16), v, bf16)


@pytest.mark.parametrize("bf16, v, bug, good, bad", [
    (False, 1, "activation pairs of a step swapped", "{b0, b1}, {$9", "{b1, b0}, {$9"),
    (False, 1, "block scales without their 2^7", "0x58005800", "0x3C003C00"),
    (False, 1, "magnitudes shifted by 2, not 3", "shr.b32 t, $4, 3", "shr.b32 t, $4, 2"),
    (False, 1, "rows g and g + 8 swapped", "{gc, hc, gd, hd}", "{hc, gc, gd, hd}"),
    (False, 4, "words 2, 3 scaled by the first group", "sg1;", "sg0;"),
    (False, 2, "the second word restarts from the input accumulator",
     "{b0, b1}, {$0, $1, $2, $3}", "{b0, b1}, {$13, $14, $15, $16}"),
    (True, 1, "odd bytes' high magnitudes shifted by 5, not 6", "shr.b32 t, $4, 6",
     "shr.b32 t, $4, 5"),
    (True, 1, "low nibbles' signs not selected", "-2013231104, 228", "-2147450880, 228"),
    (True, 1, "scales times 2^99, not 2^100", "0f71800000", "0f71000000"),
    (True, 1, "the products' addend 1, not -0", "mov.b32 k, 0x80008000",
     "mov.b32 k, 0x3F803F80"),
    (True, 1, "operands read as fp16", ".f32.bf16.bf16.f32", ".f32.f16.f16.f32"),
    (True, 2, "row g + 8's scale from row g", "bf16x2.f32 sh0, fb, fb", "bf16x2.f32 sh0, fa, fa"),
    (False, 1, "activations paired (0, 1), not (0, 4)", "prmt.b32 b0, xa, xc, 21520;",
     "prmt.b32 b0, xa, xc, 12816;"),
    (True, 1, "the high pairs' halves swapped", "prmt.b32 b3, xb, xd, 30258;",
     "prmt.b32 b3, xb, xd, 12870;"),
    (True, 2, "the second word's activations from the first's", "{xa, xb}, $10;",
     "{xa, xb}, $9;"),
])
def test_mma_ptx_check_fails_on_injected_bugs(bf16, v, bug, good, bad):
    """The warp emulation above fails on each of these bugs in the fp16 or the bf16 PTX."""
    from freetoken.kernels import nvfp4_ptx

    program = nvfp4_ptx.mma_asm(v, bf16=bf16)
    assert good in program and nvfp4_ptx.mma_operands(2)["acc"] == [13, 14, 15, 16]
    with pytest.raises(AssertionError, match="PTX"):
        _check_mma_ptx(program.replace(good, bad), v, bf16)


def _check_mma_ptx(program: str, v: int, bf16: bool = False) -> None:
    from freetoken.kernels.nvfp4_ptx import BF16_SCALE_EXP, mma_operands

    ops = mma_operands(v)
    gen = np.random.default_rng(v)
    scale_bytes = [0x00, 0x01, 0x07, 0x08, 0x38, 0x7E] + gen.integers(0, 0x7F, 10).tolist()
    factor = 2.0 ** (BF16_SCALE_EXP - 126) if bf16 else 2.0 ** -7
    for trial in range(8):
        words = gen.integers(0, 2**32, (16, 4 * v), dtype=np.uint64)
        if trial == 0:   # every code at every position
            words[:] = [[sum(((r + 5 * wd + j) % 16) << 4 * j for j in range(8))
                         for wd in range(4 * v)] for r in range(16)]
        scales = gen.choice(scale_bytes, (16, 2 * v))       # row, 16-input group
        # column n, input k: fp16, or bf16 (as bits)
        x16 = torch.from_numpy(gen.standard_normal((8, 32 * v)) * 4.0**gen.integers(-3, 4))
        x16 = x16.to(torch.bfloat16 if bf16 else torch.float16)
        x = x16.double().numpy()
        c = gen.standard_normal((16, 8)).astype(np.float32)
        # x in input order, as the kernels read it: lane t's word i is inputs 8 (v t + i) ..
        # + 7 of its column, the int64s 2 (v t + i) and 2 (v t + i) + 1 (`b_tile`)
        as64 = np.ascontiguousarray(x16.view(torch.int16).numpy().view(np.uint16)).view(np.uint64)
        lanes = []
        for lane in range(32):
            g, t = lane // 4, lane % 4
            regs = {}
            for i in range(v):
                regs[f"${ops['wg'][i]}"] = int(words[g, t * v + i])
                regs[f"${ops['wh'][i]}"] = int(words[g + 8, t * v + i])
                regs[f"${ops['b0'][i]}"] = int(as64[g, 2 * (v * t + i)])
                regs[f"${ops['b1'][i]}"] = int(as64[g, 2 * (v * t + i) + 1])
            for j, n in enumerate(ops["scales"]):
                grp = t * v // 2 + j
                regs[f"${n}"] = int(scales[g, grp]) | int(scales[g + 8, grp]) << 8
            for i, n in enumerate(ops["acc"]):
                regs[f"${n}"] = int(np.float32(c[g + 8 * (i // 2), 2 * t + i % 2])
                                    .view(np.uint32))
            lanes.append(regs)
        out = ptx_emulator.run(program, lanes)
        w = np.zeros((16, 32 * v))
        for r in range(16):
            for k in range(32 * v):
                s = float(torch.tensor([int(scales[r, k // 16])], dtype=torch.uint8)
                          .view(torch.float8_e4m3fn).float())
                w[r, k] = _e2m1((int(words[r, k // 8]) >> 4 * (k % 8)) & 0xF) * s * factor
        want = w @ x.T + c
        # the mma rounds to float32 (between its steps too): bound by the terms' size
        size = np.abs(w) @ np.abs(x).T + np.abs(c)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(4):
                got = float(np.uint32(out[lane][f"${i}"]).view(np.float32))
                at = (g + 8 * (i // 2), 2 * t + i % 2)
                ref = want[at]
                assert abs(got - ref) <= 1e-6 * size[at], (
                    f"trial {trial} lane {lane} d{i}: PTX {got}, reference {ref}")


def test_register_cap_is_gate_ups_launch_option_and_refuses_what_ptxas_cannot_take():
    """`Tiles.mma_maxnreg` becomes gate_up's `maxnreg` launch option (nothing where unset);
    a cap outside 24..255 is refused, naming the field."""
    from freetoken.kernels.nvfp4_launch import Tiles
    from freetoken.kernels.nvfp4_mma_launch import register_cap

    assert register_cap(Tiles()) == {} and register_cap(Tiles(mma_maxnreg=88)) == {"maxnreg": 88}
    for bad in (0, 16, 256):
        with pytest.raises(ValueError, match=f"Tiles.mma_maxnreg {bad}"):
            Tiles(mma_maxnreg=bad)


def test_mma_shape_rule():
    """V is the largest of 4, 2, 1 with whole chunks of 32 V inputs; the K split doubles
    while a launch has few warps (or below a minimum split), up to mma_max_split, keeping
    >= 1 step per warp."""
    from freetoken.kernels.nvfp4_launch import GPU_TILES, Tiles
    from freetoken.kernels.nvfp4_mma_launch import mma_shape

    assert mma_shape(128, 512, 2048, 1, GPU_TILES) == (4, 1, 16, 1)      # many warps
    v, split, chunks, _ = mma_shape(8, 512, 2048, 1, GPU_TILES)          # one token
    assert (v, chunks, split) == (4, 16, 8)                                 # 256 x 8 warps
    assert mma_shape(1, 2048, 64, 8, GPU_TILES)[:3] == (2, 8, 1)           # TP 8 down
    assert mma_shape(1, 32, 80, 1, GPU_TILES)[:3] == (1, 2, 3)             # 2.5 chunks
    assert mma_shape(1, 64, 2048, 1, Tiles(mma_tiles=2))[3] == 2
    # down at 16 tokens: 2048 warps unsplit, each walking 8 slots x 4 chunks alone; down
    # splits at least mma_down_min_split ways, where a warp keeps a step
    assert mma_shape(16, 2048, 512, 8, GPU_TILES)[:3] == (4, 1, 4)
    assert mma_shape(16, 2048, 512, 8, GPU_TILES, GPU_TILES.mma_down_min_split)[:3] == (4, 2, 4)
    assert mma_shape(1, 32, 16, 1, GPU_TILES, 2)[1] == 1                   # one step


def test_mma_path_is_for_16_bit_activations_on_gpus():
    """On a CPU (and for float32 activations anywhere) decode keeps the CUDA-core kernels."""
    from freetoken.kernels.nvfp4_launch import GPU_TILES, uses_mma

    assert not uses_mma(torch.zeros(1, 16, dtype=torch.bfloat16), GPU_TILES)


@pytest.fixture
def mma_in_interpreter(monkeypatch):
    """The tensor-core decode kernels run in Triton's interpreter, their mma emulated over the
    whole tensor (`_mma_portable`, the same fragments as the PTX); the CUDA-core decode
    launchers refuse, so a test cannot pass on them."""
    from interpreted import require_interpreter

    from freetoken.kernels import nvfp4_launch

    def refuse(*args, **kwargs):
        raise AssertionError("decode took the CUDA-core kernels, not the mma ones")

    require_interpreter()
    monkeypatch.setattr(nvfp4_launch, "uses_mma", lambda x, tiles: True)
    monkeypatch.setattr(nvfp4_launch, "gate_up_decode_launch", refuse)
    monkeypatch.setattr(nvfp4_launch, "down_decode_launch", refuse)


def _routing(tokens, experts, top_k, hidden, seed, dtype=torch.bfloat16):
    """x [tokens, hidden] in `dtype` (the mma path's 16-bit activations), routing weights and
    ids."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=gen), -1).topk(top_k)
    return x, weights, ids


def _rel_l2(got, want):
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


def _reference_moe(x, weights, ids, **w):
    """The float32 reference of the 16-bit x's values."""
    return reference_moe(x.float(), weights, ids, **w)


H_BF16_REL_L2 = 4e-3
"""Routed-expert sums on the mma path against the float32 reference: h travels from gate_up
to down as bf16 (2^-9 relative rounding, as the model's own h and the prefill kernels')."""


def _reference_h(x, weights, ids, w, inter):
    """float32 h of every (token, slot) pair as gate_up stores it: silu(gate) * up times the
    routing weight and down's global scale."""
    from freetoken.layers.quantization.nvfp4.reference import dequantize_w13

    rows = []
    for t, e in enumerate(ids.reshape(-1).tolist()):
        tok, slot = divmod(t, ids.shape[1])
        gate, up = (dequantize_w13(w["w13"][e], w["w13_scale"][e], w["w13_global"][e])
                    @ x[tok].float()).split(inter)
        rows.append(torch.nn.functional.silu(gate) * up * weights[tok, slot].float()
                    * w["w2_global"][e])
    return torch.stack(rows)


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tiles, dtype", [
    (3, 6, 2, 48, 16, {}, torch.bfloat16),          # 1 word per lane, the last chunk half
    (5, 8, 3, 64, 64, {"mma_max_split": 1}, torch.float16),  # 2 words, one warp a program
    (2, 4, 3, 256, 32, {"mma_tiles": 2}, torch.bfloat16),    # 4 words, split K, 2 tiles
    (16, 4, 4, 64, 32, {}, torch.float16),          # 16 pairs per expert
    (3, 6, 2, 64, 32, {"mma_maxnreg": 88}, torch.bfloat16),  # gate_up's register cap
])
def test_mma_decode_matches_reference(mma_in_interpreter, tokens, experts, top_k, hidden,
                                      inter, tiles, dtype):
    """gate_up and down on the mma path (bf16 and fp16 activations; K split across warps,
    partial chunks, rows past the end of a tile, many pairs per expert) give the reference's
    routed-expert sum of x's values up to the bf16 rounding of h (as the model's own h) and
    of the output; and gate_up's h is the bf16 h of every pair, in input order."""
    from freetoken.kernels import nvfp4_launch, nvfp4_mma_launch, nvfp4_moe

    w = make_experts(experts, hidden, inter, 1, seed=tokens)
    x, weights, ids = _routing(tokens, experts, top_k, hidden, seed=tokens, dtype=dtype)
    want = _reference_moe(x, weights, ids, **w)
    tiles = nvfp4_launch.Tiles(**tiles)
    got = nvfp4_moe.fused_moe(x, weights, ids, **w, path="decode", tiles=tiles)
    assert got.dtype == dtype and _rel_l2(got, want) < H_BF16_REL_L2
    h16 = nvfp4_mma_launch.gate_up_mma_launch(
        x, ids.reshape(-1).to(torch.int32), weights.reshape(-1), w["w13"],
        w["w13_scale"].view(torch.uint8), w["w13_global"], w["w2_global"], inter, top_k, tiles)
    assert h16.shape == (tokens * top_k, inter)
    assert _rel_l2(h16, _reference_h(x, weights, ids, w, inter)) < 5e-3


def _shared_case(experts, hidden, inter, seed, dtype, reciprocal=False):
    """Routed experts and a shared expert of their shapes (the last of `experts + 1`
    generated ones; every global stored as its reciprocal where `reciprocal`, as
    compressed-tensors stores them) with a sigmoid gate: (all experts' tensors with
    multiplying globals, the routed ones as stored, the `SharedSlot`)."""
    from freetoken.kernels.nvfp4_mma_launch import SharedSlot

    full = make_experts(experts + 1, hidden, inter, 1, seed=seed)
    routed = {k: v[:experts] for k, v in full.items()}
    g13, g2 = full["w13_global"][experts], full["w2_global"][experts:]
    if reciprocal:
        g13, g2 = 1.0 / g13, 1.0 / g2
        routed["w13_global"] = 1.0 / routed["w13_global"]
        routed["w2_global"] = 1.0 / routed["w2_global"]
    gen = torch.Generator().manual_seed(seed + 1)
    gate = (torch.randn(hidden, generator=gen) * 2 / hidden**0.5).to(dtype)
    slot = SharedSlot(full["w13"][experts], full["w13_scale"][experts], g13, 0, 1,
                      full["w2"][experts], full["w2_scale"][experts], g2, gate, reciprocal)
    return full, routed, slot


def _reference_with_shared(x, weights, ids, full, slot, residual=None):
    """The float32 reference: the shared expert as expert E of `full`, weighted by its gate
    (logit and sigmoid rounded to x's dtype, as the MoE block's combine rounds them), then
    the block's output rounded and the residual added."""
    experts = full["w13"].shape[0] - 1
    logit = (x.float() @ slot.gate_weight.float()).to(x.dtype).float()
    gate = torch.sigmoid(logit).to(x.dtype).float()
    out = reference_moe(x.float(), torch.cat([weights.float(), gate[:, None]], 1),
                        torch.cat([ids, torch.full_like(ids[:, :1], experts)], 1), **full)
    return out if residual is None else out.to(x.dtype).float() + residual.float()


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tiles, dtype, reciprocal", [
    (1, 6, 2, 64, 32, {}, torch.bfloat16, False),                   # one token, 2 words
    (3, 4, 3, 256, 64, {"mma_tiles": 2}, torch.float16, True),       # split K, 2 tiles
    (5, 8, 2, 48, 16, {"mma_max_split": 1}, torch.bfloat16, True),   # partial chunk
    (3, 4, 3, 256, 64, {"mma_max_split": 2}, torch.bfloat16, False),  # no masks
])
def test_mma_decode_takes_the_shared_expert_as_one_more_slot(mma_in_interpreter, tokens,
                                                             experts, top_k, hidden, inter,
                                                             tiles, dtype, reciprocal):
    """With a `SharedSlot` every token's slot top_k is the shared expert (its own weights,
    block scales and globals, weighted by sigmoid(gate . x); every global stored as the
    reciprocal in some cases, inverted in the kernel):
    the routed sum plus the gated shared expert, as the reference computes them with the
    shared expert as one more expert; the residual, where given, added after the block's
    output is rounded. gate_up's h holds each token's routed slots, then its shared one. The
    shared expert's share and the residual each move the output far beyond the tolerance,
    so dropping either fails."""
    from freetoken.kernels import nvfp4_launch, nvfp4_mma_launch, nvfp4_moe

    full, routed, slot = _shared_case(experts, hidden, inter, tokens + hidden, dtype,
                                      reciprocal)
    x, weights, ids = _routing(tokens, experts, top_k, hidden, seed=tokens, dtype=dtype)
    tiles = nvfp4_launch.Tiles(**tiles)
    if hidden == 256 and not reciprocal:
        v, split, _, row_tiles = nvfp4_mma_launch.mma_shape(tokens, hidden, inter, top_k + 1,
                                                            tiles)
        assert nvfp4_mma_launch.mma_full(hidden, inter, top_k + 1, v, split, row_tiles)
    want = _reference_with_shared(x, weights, ids, full, slot)
    got = nvfp4_moe.fused_moe(x, weights, ids, **routed, tiles=tiles, shared=slot,
                              reciprocal=reciprocal)
    assert got.dtype == dtype and _rel_l2(got, want) < H_BF16_REL_L2
    routed_only = {k: v[:experts] for k, v in full.items()}
    assert _rel_l2(_reference_moe(x, weights, ids, **routed_only), want) > 10 * H_BF16_REL_L2
    residual = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5))
                * want.norm(dim=1, keepdim=True) / hidden**0.5).to(dtype)
    want_res = _reference_with_shared(x, weights, ids, full, slot, residual)
    got_res = nvfp4_moe.fused_moe(x, weights, ids, **routed, tiles=tiles, shared=slot,
                                  residual=residual, reciprocal=reciprocal)
    assert _rel_l2(got_res, want_res) < H_BF16_REL_L2
    assert _rel_l2(got, want_res) > 10 * H_BF16_REL_L2
    h16 = nvfp4_mma_launch.gate_up_mma_launch(
        x, ids.reshape(-1).to(torch.int32), weights.reshape(-1), routed["w13"],
        routed["w13_scale"].view(torch.uint8), routed["w13_global"], routed["w2_global"],
        inter, top_k, tiles, shared=slot, reciprocal=reciprocal).view(tokens, top_k + 1, inter)
    shared_ids = torch.full_like(ids[:, :1], experts)
    logit = (x.float() @ slot.gate_weight.float()).to(dtype).float()
    gate = torch.sigmoid(logit).to(dtype).float()[:, None]
    assert _rel_l2(h16[:, :top_k].reshape(-1, inter),
                   _reference_h(x, weights, ids, routed_only, inter)) < 5e-3
    assert _rel_l2(h16[:, top_k], _reference_h(x, gate, shared_ids, full, inter)) < 5e-3


def test_mma_decode_refuses_a_shared_slot_it_cannot_take(mma_in_interpreter):
    """A shared expert whose down is not a routed expert's shape, or whose globals are not
    float32, is refused, named; so are a shared slot on the prefill path and a residual of
    the wrong shape."""
    import dataclasses

    from freetoken.formats.nvfp4.format import NVFP4FormatError
    from freetoken.kernels import nvfp4_moe

    _, routed, slot = _shared_case(4, 64, 32, 3, torch.bfloat16)
    x, weights, ids = _routing(2, 4, 2, 64, seed=3)
    bad = dataclasses.replace(slot, w2=slot.w2[:, :8])
    with pytest.raises(NVFP4FormatError, match=r"shared expert w2 has shape \(64, 8\)"):
        nvfp4_moe.fused_moe(x, weights, ids, **routed, shared=bad)
    bad = dataclasses.replace(slot, w2_global=slot.w2_global.to(torch.float64))
    with pytest.raises(NVFP4FormatError, match="shared expert w2_global is torch.float64"):
        nvfp4_moe.fused_moe(x, weights, ids, **routed, shared=bad)
    with pytest.raises(ValueError, match="needs the tensor-core decode.*prefill"):
        nvfp4_moe.fused_moe(x, weights, ids, **routed, shared=slot, path="prefill")
    with pytest.raises(ValueError, match=r"residual \(2, 32\) does not fit x \(2, 64\)"):
        nvfp4_moe.fused_moe(x, weights, ids, **routed, shared=slot,
                            residual=x[:, :32].contiguous())


@pytest.mark.parametrize("bug", [None, "ungated", "no residual", "routed only"])
def test_kernels_check_catches_a_broken_shared_slot(mma_in_interpreter, monkeypatch, bug):
    """The `kernels` check's "moe+shared" case (a TP 2 shard here; the GPU matrix has every
    TP size) passes on the tensor-core decode with the shared slot, against the format
    oracle and the torch backend, and fails when the kernels weight the shared expert by
    sigmoid(0), drop the residual or drop the shared slot."""
    import dataclasses

    from freetoken.kernels import nvfp4_moe
    from freetoken_verify.checks.kernels.nvfp4 import run_case
    from freetoken_verify.checks.kernels.nvfp4_cases import KernelCase

    original = nvfp4_moe.fused_moe

    def broken(*args, shared=None, residual=None, **kwargs):
        if bug == "ungated":
            shared = dataclasses.replace(shared, gate_weight=torch.zeros_like(
                shared.gate_weight))
        return original(*args, shared=None if bug == "routed only" else shared,
                        residual=None if bug == "no residual" else residual, **kwargs)

    monkeypatch.setattr(nvfp4_moe, "fused_moe", broken)
    row = run_case(KernelCase("moe+shared", 3, 4, 2, 64, 64, 2), "cpu", torch.bfloat16,
                   seed=1)
    assert row["backend_failure"] is None, row
    assert (row["failure"] is None) == (bug is None), row


def test_moe_block_takes_its_nvfp4_shared_expert_as_one_more_slot(mma_in_interpreter,
                                                                  monkeypatch):
    """A Qwen3.5 MoE block of the bundled compressed-tensors NVFP4 checkpoint (shared expert
    NVFP4 of the routed experts' size, reciprocal globals), its experts on the tensor-core
    decode: the decoder layer's second half is the router, the routing, gate_up with the
    shared slot and down with the residual, no combine launch, and gives the torch path's
    `residual + block(x)` up to bf16 rounding; with `fused_moe.SHARED_IN_ROWS` off the
    shared expert takes its own launches and the combine, to the same result. Dropping the
    shared expert's share or the block's output would each fail."""
    from conftest import GOLDEN

    from freetoken.config import EngineConfig
    from freetoken.context import ForwardContext, device_batch, set_forward_context
    from freetoken.engine.core import EngineCore
    from freetoken.kernels import fused_moe, gemv, nvfp4_mma_launch
    from freetoken.layers.quantization.nvfp4.backend import TRITON, BackendChoice
    from freetoken.models.qwen3_5_moe.moe import SparseMoeBlock
    from freetoken.models.registry import load_config

    folder = GOLDEN / "tiny-qwen3.5-moe-nvfp4-ct"
    core = EngineCore(folder, load_config(folder),
                      EngineConfig(dtype="bfloat16", progress=False, max_num_seqs=1,
                                   enforce_eager=True), torch.device("cpu"))
    block = next(m for m in core.model.modules() if isinstance(m, SparseMoeBlock))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, block.experts.hidden, generator=gen).to(torch.bfloat16)
    residual = (torch.randn(3, block.experts.hidden, generator=gen) * 0.1).to(torch.bfloat16)
    want = residual.float() + block(x).float()
    # the triton backend on bf16 in the interpreter (which it refuses for its CUDA-core
    # kernels; the mma ones emulate their products exactly)
    monkeypatch.setattr(block.experts, "backend_for",
                        lambda x: BackendChoice(TRITON, "the mma decode in the interpreter"))
    calls = {"combine": 0, "shared slot": 0}
    combine, gate_up = gemv.moe_combine, nvfp4_mma_launch.gate_up_mma_launch

    def counted_combine(*args, **kwargs):
        calls["combine"] += 1
        return combine(*args, **kwargs)

    def counted_gate_up(*args, shared=None, **kwargs):
        calls["shared slot"] += shared is not None
        return gate_up(*args, shared=shared, **kwargs)

    monkeypatch.setattr(gemv, "moe_combine", counted_combine)
    monkeypatch.setattr(nvfp4_mma_launch, "gate_up_mma_launch", counted_gate_up)
    steps = [1, 1, 1]
    set_forward_context(ForwardContext(False, steps, steps, torch.zeros(3, dtype=torch.long),
                                       [[0]] * 3, [0, 1, 2],
                                       device_batch(steps, steps, [[0]] * 3, [0, 1, 2],
                                                    "cpu")))
    shared_expert = (block.shared_expert.gate_up_proj, block.shared_expert.down_proj,
                     block.shared_expert_gate)
    # a shared expert that does not fit (here its gate's dtype) stays apart
    assert block.experts.shared_slot(x.half(), *shared_expert) is None
    assert block.experts.shared_slot(x, *shared_expert) is not None
    try:
        got = block._from_logits(x, block.gate(x), residual=residual)
        assert calls == {"combine": 0, "shared slot": 1}, calls
        monkeypatch.setattr(fused_moe, "SHARED_IN_ROWS", False)
        apart = block._from_logits(x, block.gate(x), residual=residual)
        assert calls == {"combine": 1, "shared slot": 1}, calls
    finally:
        set_forward_context(None)
    # bf16 stores truncate in the interpreter (the combine's and down's): 2^-8 relative
    assert _rel_l2(got, want) < 2e-2 and _rel_l2(apart, want) < 2e-2
    shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    assert _rel_l2(want - shared.float(), want) > 0.1 and _rel_l2(residual, want) > 0.5


def test_mma_decode_with_an_expert_repeated(mma_in_interpreter):
    """A token routed twice to one expert counts once per slot."""
    from freetoken.kernels import nvfp4_moe

    w = make_experts(4, 64, 32, 1, seed=7)
    x, weights, _ = _routing(3, 4, 3, 64, seed=7)
    ids = torch.tensor([[1, 1, 2], [0, 3, 0], [2, 2, 2]])
    want = _reference_moe(x, weights, ids, **w)
    assert _rel_l2(nvfp4_moe.fused_moe(x, weights, ids, **w, path="decode"), want) < H_BF16_REL_L2


@pytest.mark.parametrize("columns", [False, True], ids=["slot per token", "token columns"])
@pytest.mark.parametrize("tokens, rows, k_inputs, dtype, bias", [
    (3, 24, 80, torch.bfloat16, True), (16, 40, 256, torch.float16, False),
    (9, 64, 128, torch.float16, False), (20, 32, 64, torch.float16, False)])
def test_dense_linear_decode_on_the_mma_path(mma_in_interpreter, monkeypatch, columns, tokens,
                                             rows, k_inputs, dtype, bias):
    """The dense NVFP4 linear's decode on the mma kernels (down with one slot per token on x
    in place, or the tokens as the mma's columns, `nvfp4_linear.COLUMNS`; the global scale
    on the sums; partial chunks, a partial row tile, whole tiles without masks) gives the
    reference of x's values up to the rounding of the output to x's dtype; the token
    columns at 3 (a block of eight), 9 and 16 (a block of sixteen, two mmas a step) and 20
    tokens (two blocks of sixteen, the second partial). (bf16 takes a bias, so its kernel
    output is float32: the interpreter truncates bf16 stores.)"""
    from freetoken.formats.nvfp4.quantizer import quantize
    from freetoken.kernels import nvfp4_linear as linear_module
    from freetoken.kernels.nvfp4_linear import nvfp4_linear
    from freetoken.layers.quantization.nvfp4.reference import reference_linear

    monkeypatch.setattr(linear_module, "COLUMNS", columns)

    gen = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(rows, k_inputs, generator=gen) * 3)
    lin = dict(packed=q.packed, block_scale=q.block_scale, global_scale=q.global_scale,
               bias=torch.randn(rows, generator=gen) if bias else None)
    x = torch.randn(tokens, k_inputs, generator=gen).to(dtype)
    got = nvfp4_linear(x, **lin, path="decode")
    assert got.dtype == dtype
    assert _rel_l2(got, reference_linear(x.float(), **lin)) < 2e-3


def test_mma_activations_are_read_in_place_when_aligned():
    """The mma kernels read 16-byte-aligned rows of 16-bit activations in place; a row that
    is not aligned is copied (its values kept), and float32 activations are refused, named."""
    from freetoken.kernels.nvfp4_mma_launch import activations

    x = torch.randn(3, 96).to(torch.bfloat16)
    assert activations(x) is x
    for view in (torch.randn(3, 104).to(torch.float16)[:, 4:84],    # starts 8 bytes in
                 torch.randn(3, 84).to(torch.bfloat16)[:, :80]):     # rows 168 bytes apart
        got = activations(view)
        assert got.data_ptr() % 16 == 0 and got.stride(0) % 8 == 0
        assert torch.equal(got[:, :80], view)
    with pytest.raises(TypeError, match="bf16 or fp16.*float32"):
        activations(torch.randn(2, 16))


def test_h_rounds_to_bf16_to_nearest_even():
    """gate_up's h is rounded to bf16 as torch rounds (to nearest, ties to even: halfway cases
    both ways, carries into the exponent, negatives, subnormals, infinities) and NaN stays
    NaN; Triton's interpreter would truncate `.to(tl.bfloat16)`."""
    from interpreted import require_interpreter

    require_interpreter()
    import bf16_rounding_kernel

    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8 + 2**-20),
                      2 - 2**-9, 3.0e38, 1e-39, -2.5e-40, float("inf"), float("-inf"),
                      0.0, -0.0, 1 / 3, -7.77, 65504.0, float("nan")], dtype=torch.float32)
    bits = torch.empty(16, dtype=torch.int16)
    bf16_rounding_kernel.bf16_bits_kernel[(1,)](x, bits, N=16)
    got = bits.view(torch.bfloat16)
    want = x.to(torch.bfloat16)
    assert torch.equal(got[:15].view(torch.int16), want[:15].view(torch.int16))
    assert torch.isnan(got[15])


def test_mma_decode_with_slots_of_very_different_sizes(mma_in_interpreter):
    """A token's slots 2^8 apart in size (routing weights 2^-8, 1, 2^8): bf16 h keeps each
    to 8 significant bits whatever its size, so the sum stays within rounding."""
    from freetoken.kernels import nvfp4_moe

    w = make_experts(4, 64, 32, 1, seed=9)
    x, _, _ = _routing(2, 4, 3, 64, seed=9)
    ids = torch.tensor([[0, 1, 2], [3, 2, 1]])
    weights = torch.tensor([[2.0**-8, 1.0, 2.0**8], [2.0**8, 2.0**-8, 1.0]])
    want = _reference_moe(x, weights, ids, **w)
    got = nvfp4_moe.fused_moe(x, weights, ids, **w, path="decode")
    assert _rel_l2(got, want) < H_BF16_REL_L2


def test_mma_decode_without_masks(mma_in_interpreter):
    """Whole row tiles, whole chunks and K splits that share the steps evenly take the
    unmasked loads (the loads ahead of the last step re-read the last chunk): the same sum;
    and a split that leaves a warp a step short keeps the masks."""
    from freetoken.kernels import nvfp4_launch, nvfp4_moe
    from freetoken.kernels.nvfp4_mma_launch import mma_full, mma_shape

    tokens, experts, top_k, hidden, inter = 3, 4, 2, 256, 64
    w = make_experts(experts, hidden, inter, 1, seed=11)
    x, weights, ids = _routing(tokens, experts, top_k, hidden, seed=11)
    tiles = nvfp4_launch.Tiles(mma_max_split=2)
    v, split, chunks, row_tiles = mma_shape(tokens * top_k, inter, hidden, 1, tiles)
    assert (chunks, split) == (2, 2) and mma_full(inter, hidden, 1, v, split, row_tiles)
    v, split, chunks, row_tiles = mma_shape(tokens, hidden, inter, top_k, tiles)
    assert mma_full(hidden, inter, top_k, v, split, row_tiles)
    want = _reference_moe(x, weights, ids, **w)
    got = nvfp4_moe.fused_moe(x, weights, ids, **w, path="decode", tiles=tiles)
    assert _rel_l2(got, want) < H_BF16_REL_L2
    assert not mma_full(64, 96, 1, 1, 2, 1)      # 3 chunks over 2 warps
    assert not mma_full(40, 64, 1, 2, 1, 1)      # a partial row tile


DOWN_EARLY = {"out_scale_ptr", "topk_ids_ptr", "w_ptr", "w_scale_ptr", "shared_w_ptr",
              "shared_w_scale_ptr", "n_rows", "k_words", "top_k", "stride_h16_pair",
              "stride_w_expert", "stride_w_row", "stride_scale_expert", "stride_scale_row",
              "stride_out_token", "stride_residual_token"}
"""What down, launched with PDL after gate_up, may read before its wait: weights, scales,
routing ids, the dense linear's global scale, sizes and strides; never h, the residual or
the output."""


def pdl_order_problems(ptx: str, waits_for_previous: bool = True) -> list[str]:
    """What breaks programmatic dependent launch in an mma decode kernel's PTX: each lets the
    next kernel launch exactly once; down (`waits_for_previous`) waits once and before the
    wait reads only `DOWN_EARLY`, stores nothing and loads at least one weight
    (`ptx_order.early_read_problems`); gate_up, an ordinary launch, has no wait."""
    from interpreted import require_interpreter
    from ptx_order import early_read_problems, param_names

    from freetoken.kernels import jit_module

    if waits_for_previous:
        require_interpreter()   # the kernels' parameters only; this process interprets
        names = param_names(jit_module("nvfp4_mma_jit").down_mma)
        return early_read_problems(ptx, names, DOWN_EARLY)
    waits = ptx.count("griddepcontrol.wait")
    launches = ptx.count("griddepcontrol.launch_dependents")
    return [] if (waits, launches) == (0, 1) else [
        f"{waits} griddepcontrol.wait and {launches} launch_dependents, want 0 and 1"]


def _pdl_ptx(tmp_path, shared: bool = False) -> dict[str, str]:
    """The PTX of the mma decode kernels as the launcher builds them for an H200 at TP 1 / 16
    tokens (with PDL; `shared`: with the shared expert's slot and the residual), compiled in
    a process without the interpreter."""
    from conftest import run_compiled

    code = (
        "import sys; from pathlib import Path\n"
        "from bench import nvfp4_sass\n"
        "from freetoken.kernels.nvfp4_launch import GPU_TILES\n"
        f"kernels = nvfp4_sass._mma_kernels(GPU_TILES, 16, 8, 2048, 512, 90, {shared})\n"
        "for name, fn, meta, warps, *_ in kernels:\n"
        "    assert meta['PDL'] == 1, meta\n"
        "    kernel = nvfp4_sass.compile_kernel(fn, meta, warps, 90)\n"
        "    (Path(sys.argv[1]) / (name + '.ptx')).write_text(kernel.asm['ptx'])\n")
    proc = run_compiled(["-c", code, str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {p.stem: p.read_text() for p in tmp_path.glob("*.ptx")}


@pytest.mark.parametrize("shared", [False, True])
def test_pdl_kernels_read_upstream_outputs_only_after_the_wait(tmp_path, shared):
    """down, launched with PDL after gate_up, loads its first weights before
    `griddepcontrol.wait` and h after it; gate_up, an ordinary launch, lets down launch early
    and waits for nothing; so with the shared expert's slot and the residual. With down's
    wait moved to the end (h read before gate_up has finished), either kernel's early
    launch dropped, or a wait in gate_up, the check fails."""
    from ptx_order import wait_moved_to_end

    ptx = _pdl_ptx(tmp_path, shared)
    assert sorted(ptx) == ["down_mma", "gate_up_mma"]
    down, gate_up = ptx["down_mma"], ptx["gate_up_mma"]
    assert pdl_order_problems(down) == []
    assert pdl_order_problems(gate_up, waits_for_previous=False) == []
    assert any("load of h16_ptr" in p for p in pdl_order_problems(wait_moved_to_end(down)))
    for name, text in ptx.items():
        dropped = text.replace("griddepcontrol.launch_dependents", "// dropped")
        assert pdl_order_problems(dropped, name == "down_mma"), name
    assert pdl_order_problems(gate_up + "\ngriddepcontrol.wait;", waits_for_previous=False)


def test_pdl_is_off_on_a_cpu():
    """Programmatic dependent launch is for the mma decode on sm_90+ GPUs only."""
    from freetoken.kernels.nvfp4_launch import GPU_TILES
    from freetoken.kernels.nvfp4_mma_launch import launches_early
    from freetoken.kernels.pdl import pdl_args

    assert not launches_early(torch.zeros(1, 16, dtype=torch.bfloat16), GPU_TILES)
    assert pdl_args(False) == {}
    assert pdl_args(True) == {"PDL": 1, "launch_pdl": True}


_PDL_GPU = """
import dataclasses
import torch
from freetoken.kernels import nvfp4_launch, nvfp4_mma_launch, nvfp4_moe
from freetoken_verify.checks.kernels.check import make_experts
w = make_experts(16, 512, 256, 2, seed=5, device="cuda")
gen = torch.Generator().manual_seed(6)
x = torch.randn(9, 512, generator=gen).cuda().bfloat16()
weights, ids = torch.softmax(torch.randn(9, 16, generator=gen), -1).topk(4)
weights, ids = weights.cuda().bfloat16(), ids.cuda()
tiles = {pdl: dataclasses.replace(nvfp4_launch.GPU_TILES, pdl=pdl) for pdl in (False, True)}
sm90 = torch.cuda.get_device_capability() >= (9, 0)
assert nvfp4_mma_launch.launches_early(x, tiles[True]) == sm90
want = nvfp4_moe.fused_moe(x, weights, ids, **w, tiles=tiles[False])
for _ in range(10):
    assert torch.equal(nvfp4_moe.fused_moe(x, weights, ids, **w, tiles=tiles[True]), want)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_decode_matches_ordinary_launches_on_a_gpu():
    """On a GPU the mma decode with PDL (where the GPU has it) gives bit for bit what
    ordinary launches give, call after call (no kernel reads an upstream output early); in a
    process of its own, since other tests here switch this one to the interpreter."""
    from conftest import run_compiled

    proc = run_compiled(["-c", _PDL_GPU])
    assert proc.returncode == 0, proc.stdout + proc.stderr
