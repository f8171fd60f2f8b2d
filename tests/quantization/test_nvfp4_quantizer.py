"""NVFP4 format and quantizer (freetoken.formats.nvfp4.format / .quantizer):
packing is bit-stable, codes are the nearest e2m1 grid point with ties to the even code, the
scales follow ModelOpt's rules, and dequant(quant(x)) stays within the format's error bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.formats.nvfp4.format import (
    E2M1_VALUES,
    NVFP4FormatError,
    dequantize,
    pack_nibbles,
    unpack_nibbles,
)
from freetoken.formats.nvfp4.quantizer import e2m1_codes, quantize

PROPERTY = settings(max_examples=150, deadline=None)
GRID = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)

magnitudes = st.one_of(
    st.just(0.0),
    st.floats(2.0 ** -100, 2.0 ** 100, width=32),  # very small to very large
    st.floats(2.0 ** -10, 2.0 ** 10, width=32),    # the usual range
    st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 448.0]),
)
values = st.builds(lambda m, neg: -m if neg else m, magnitudes, st.booleans())


def _make_weight(rows: int, flat: list[float]) -> torch.Tensor:
    return torch.tensor(flat, dtype=torch.float32).reshape(rows, -1)


def _half_step(mag: torch.Tensor) -> torch.Tensor:
    """Half the e2m1 grid spacing at magnitude `mag` (spacing .5 below 2, 1 below 4, else 2)."""
    return torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))


def test_packing_is_bit_stable_for_every_byte():
    """unpack then pack gives back each of the 256 bytes, and the even element is the low
    nibble."""
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    codes = unpack_nibbles(every)
    assert torch.equal(pack_nibbles(codes), every)
    assert torch.equal(codes[..., 0::2], every & 0x0F), "element 2j must be the low nibble"
    assert torch.equal(codes[..., 1::2], every >> 4)


@PROPERTY
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_unpack_inverts_pack(codes):
    """pack then unpack gives back any even-length list of 4-bit codes."""
    c = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(c)), c)


@PROPERTY
@given(st.lists(st.floats(-20.0, 20.0, width=32), min_size=1, max_size=64))
def test_codes_are_nearest_grid_point_ties_to_even(ys):
    """Every value maps to the nearest of +-{0, .5, 1, 1.5, 2, 3, 4, 6} (clamped at 6), and
    a value exactly between two grid points maps to the one with the even code."""
    y = torch.tensor(ys, dtype=torch.float32)
    code = e2m1_codes(y).long()
    got = torch.tensor(E2M1_VALUES, dtype=torch.float64)[code]
    dist = (y.double().abs().unsqueeze(-1) - GRID).abs()
    best = dist.min(dim=-1).values
    chosen = (y.double().abs() - got.abs()).abs()
    assert torch.equal(chosen, best), f"not the nearest grid point: {ys} -> {got.tolist()}"
    tie = (dist == best.unsqueeze(-1)).sum(-1) > 1
    assert bool(((code[tie] & 7) % 2 == 0).all()), f"tie not to even: {y[tie].tolist()}"
    assert bool(((code >> 3) == (y < 0).long()).all()), "sign bit must follow x < 0"


@PROPERTY
@given(st.integers(-20, 20), st.integers(-9, 8), st.lists(st.integers(0, 13), min_size=15,
                                                          max_size=15))
def test_exact_ties_round_to_even(k, j, picks):
    """With the global scale 2^k and a block scale of exactly 2^j (both powers of two, so
    x / (scale * global) is exact), values halfway between grid points take the even code:
    .25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (and negatives)."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    g, step = 2.0 ** k, 2.0 ** (k + j)
    block = [6.0] + [ties[p % 7] * (-1 if p >= 7 else 1) for p in picks]
    amax_block = [6.0 * 448.0] + [0.0] * 15  # sets amax = 2688 * g exactly: global = g
    w = torch.tensor([[v * g for v in amax_block], [v * step for v in block]], dtype=torch.float32)
    q = quantize(w)
    assert float(q.global_scale) == g and float(q.block_scale[1, 0].float()) == 2.0 ** j
    deq = q.dequantize()[1]
    expect = torch.tensor([6.0] + [want[abs(v)] * (1 if v > 0 else -1) for v in block[1:]])
    assert torch.equal(deq, (expect * step).float()), f"ties: {block} -> {(deq / step).tolist()}"


@PROPERTY
@given(st.integers(1, 3), st.data())
def test_dequant_within_format_error_bound(rows, data):
    """dequant(quant(x)) is within the NVFP4 error bound, element by element.

    With g the global scale, S = block_amax / (6 g) the exact block scale, s = e4m3(S) the
    stored one and d = s g the block's step: if |x| / d <= 6, rounding to the nearest e2m1
    point errs by at most half the grid spacing at that magnitude (.25 below 2, .5 below 4,
    1 up to 6) times d, which is <= max(d, |x|) / 4; if |x| / d > 6 (s rounded below S), the
    clamp to 6 d errs by |x| - 6 d <= 6 g (S - s). e4m3 rounding makes S - s <= S / 16 for
    normal scales (S >= 2^-6) and <= 2^-10 for subnormal ones. So
    |x - x_hat| <= max(d, |x|) / 4 + 6 g max(0, S - s), plus float32 rounding of the
    computation (1e-6 |x| here)."""
    flat = data.draw(st.lists(values, min_size=rows * 32, max_size=rows * 32))
    w = _make_weight(rows, flat)
    q = quantize(w)
    x = w.double().reshape(rows, 2, 16)
    g = float(q.global_scale)
    s = q.block_scale.double()
    big_s = x.abs().amax(-1) / (6 * g) if g > 0 else torch.zeros_like(s)
    scale_err = (big_s - s).clamp(min=0)
    allowed = torch.maximum(big_s / 16, torch.full_like(big_s, 2.0 ** -10))
    assert bool((scale_err <= allowed).all()), "e4m3 block-scale rounding out of bounds"
    d = (s * g).unsqueeze(-1)
    bound = torch.maximum(d, x.abs()) / 4 + 6 * g * scale_err.unsqueeze(-1) + 1e-6 * x.abs()
    err = (q.dequantize().double().reshape(rows, 2, 16) - x).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"element {worst}: x={x.flatten()[worst].item()!r} err={err.flatten()[worst].item()} "
        f"bound={bound.flatten()[worst].item()}")
    tight = d * _half_step((x.abs() / d.clamp(min=1e-45)).clamp(max=6))
    fits = (x.abs() <= 6 * d)
    assert bool((err[fits] <= tight[fits] * (1 + 1e-6) + 1e-6 * x.abs()[fits]).all()), \
        "within range, the error must be at most half a grid step"


def test_scales_follow_modelopt_rules():
    """global = amax / (6 * 448); block scale = e4m3(block_amax / (6 * global)); an all-zero
    block gets 1.0; an all-zero tensor dequantizes to zeros."""
    w = torch.zeros(2, 32)
    w[0, :16] = torch.linspace(-3.0, 7.0, 16)
    w[1, 16:] = torch.linspace(0.1, 0.2, 16)
    q = quantize(w)
    assert float(q.global_scale) == pytest.approx(7.0 / 2688, rel=1e-7)
    amax = w.reshape(2, 2, 16).abs().amax(-1)
    want = torch.where(amax == 0, 1.0, amax / (6 * q.global_scale)).to(torch.float8_e4m3fn)
    assert torch.equal(q.block_scale.view(torch.uint8), want.view(torch.uint8))
    zero = quantize(torch.zeros(3, 16))
    assert torch.equal(zero.dequantize(), torch.zeros(3, 16))


def test_format_errors_name_the_tensor():
    """Bad shapes and dtypes raise NVFP4FormatError naming the tensor and the sizes."""
    q = quantize(torch.randn(4, 32))
    with pytest.raises(NVFP4FormatError, match=r"experts\.0\.w.*\(4, 3\).*\(4, 2\)"):
        dequantize(q.packed, q.block_scale[:, :1].repeat(1, 3), q.global_scale, "experts.0.w")
    with pytest.raises(NVFP4FormatError, match="must be uint8"):
        dequantize(q.packed.float(), q.block_scale, q.global_scale)
    with pytest.raises(NVFP4FormatError, match="not a multiple of the 16-element group"):
        quantize(torch.randn(2, 24))
