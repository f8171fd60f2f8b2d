"""The weight-only quantized GEMMs (`freetoken.kernels.quant_gemm`) in Triton's interpreter with
float32 activations, against a float64 oracle computed from each format's definition (every
weight element times its own block's scale, its segment's per-tensor scale or global), never
from the code under test:

- the kernels alone: block FP8 with partial last blocks, block sizes that are and are not
  powers of two, shards starting inside a column block (each of the three places a scale is
  applied), split inputs, decode and prefill tiles; NVFP4 in both global conventions;
- the linear methods, built for every rank of TP 1, 2, 4 and 8 from full checkpoint tensors
  cut by the shard specs the loader uses: a fused GatedDeltaNet-like [q | k | v] + [z] layer
  whose segments start inside blocks and whose ranks share blocks, a row-parallel layer
  whose ranks share a column block, per-tensor scales and globals unequal per segment, KV
  heads replicated; the layer's `apply` routed through the kernel with leading dims and a
  bias;
- the FP8 and NVFP4 row kernels, and their decode fusions (the input RMSNorm, stored for the
  next layers, and the residual, with and without a split), refused off the row kernel;
- injected bugs the comparison must catch: one segment's scale rows for all, the column
  offset dropped, the divisor global used as a multiplier, one global for every segment,
  the norm or the residual dropped, the norm's 1 + w read as w."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from interpreted import TP_SIZES, interpreter  # noqa: F401  (module-wide fixture)
from torch import nn

from freetoken.formats.fp8.block import quantize as quantize_block
from freetoken.formats.fp8.tensor import quantize_per_tensor
from freetoken.formats.nvfp4.format import dequantize as nvfp4_values
from freetoken.formats.nvfp4.quantizer import quantize as quantize_nvfp4
from freetoken.formats.quant.format import (
    COMPRESSED_TENSORS,
    FP8_BLOCK,
    FP8_TENSOR,
    HF_FP8,
    MODELOPT,
    NVFP4,
    ModuleFormat,
)
from freetoken.kernels import gemv, quant_gemm
from freetoken.layers.quantization.method import Split, method_for

RTOL = 1e-5


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitude, so a scale read from the wrong block shows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 2, rows)[:, None]


def _x(tokens: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed + 1000))


def _block_oracle(codes, scale, block, row_offset=0, col_offset=0) -> torch.Tensor:
    """float64 values: each e4m3 code times the scale of the block holding it."""
    rows = (row_offset + torch.arange(codes.shape[0])) // block[0]
    cols = (col_offset + torch.arange(codes.shape[1])) // block[1]
    return codes.double() * scale.double()[rows][:, cols]


def _assert_oracle(got: torch.Tensor, x: torch.Tensor, weight64: torch.Tensor, what: str,
                   bias: torch.Tensor | None = None) -> None:
    want = x.double() @ weight64.T
    if bias is not None:
        want = want + bias.double()
    err = float((got.double() - want).norm() / want.norm())
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err < RTOL, f"{what}: relative L2 error {err:.2e} against the float64 oracle"


# -- the kernels alone -------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block,col_offset,mode", [
    ((40, 48), (16, 16), 0, 1),      # whole blocks, the scale once per step
    ((37, 200), (16, 24), 8, 2),     # partial blocks, 24-wide: the scale per element
    ((50, 100), (7, 5), 3, 2),       # blocks of 7 x 5, a shard 3 inputs into its block
    ((64, 192), (128, 128), 64, 1),  # a TP 8 down_proj-like shard, half a block in
    ((30, 40), (16, 64), 0, 0),      # one column block over every input: once per output
])
@pytest.mark.parametrize("tokens", [1, 5, 16, 40])
def test_fp8_block_kernel_follows_the_definition(shape, block, col_offset, mode, tokens):
    """x W^T for a block-FP8 weight whose shard starts `col_offset` inputs into its first
    column block equals the float64 oracle, at decode and prefill token counts; the
    parametrisation covers every scale placement (`_fp8_scale_mode`)."""
    rows, cols = shape
    codes, scale = quantize_block(_weight(rows, cols + col_offset, rows), block)
    codes = codes[:, col_offset:].contiguous()
    tiles = quant_gemm.choose_tiles(tokens, rows, cols, "fp8")
    assert quant_gemm._fp8_scale_mode(cols, block[1], col_offset, tiles.block_k)[0] == mode
    x = _x(tokens, cols, rows)
    scale_row = (torch.arange(rows) // block[0]).to(torch.int32)
    got = quant_gemm.fp8_gemm(x, codes, scale.float(), scale_row, block[1], col_offset)
    _assert_oracle(got, x, _block_oracle(codes, scale, block, 0, col_offset),
                   f"{shape} block {block} offset {col_offset} T={tokens}")


@pytest.mark.parametrize("shape,block,col_offset,block_k,split,mode", [
    ((40, 256), (16, 32), 0, 128, 1, 1),   # whole blocks: the scale per 32-input group
    ((37, 200), (16, 24), 8, 64, 2, 2),    # 24-wide blocks, 8 inputs in: per element, split
    ((64, 192), (128, 128), 64, 64, 1, 1), # half a block in: groups of 64 inputs
    ((30, 40), (16, 64), 0, 32, 1, 0),     # one column block: once per output row
])
@pytest.mark.parametrize("block_n", [1, 4])
def test_fp8_row_kernel_follows_the_definition(shape, block, col_offset, block_k, split, mode,
                                               block_n):
    """The FP8 kernel without tensor cores (`rows` tiles: one token per program, `block_n`
    rows each) equals the float64 oracle for every scale placement, over partial row blocks
    and input steps, with the inputs split and a bias."""
    rows, cols = shape
    codes, scale = quantize_block(_weight(rows, cols + col_offset, rows), block)
    codes = codes[:, col_offset:].contiguous()
    tiles = quant_gemm.QuantTiles(1, block_n, block_k, split=split, rows=True)
    assert quant_gemm._fp8_scale_mode(cols, block[1], col_offset, block_k)[0] == mode
    x, bias = _x(3, cols, rows), torch.randn(rows)
    scale_row = (torch.arange(rows) // block[0]).to(torch.int32)
    got = quant_gemm.fp8_gemm(x, codes, scale.float(), scale_row, block[1], col_offset,
                              bias=bias, tiles=tiles)
    _assert_oracle(got, x, _block_oracle(codes, scale, block, 0, col_offset),
                   f"rows {tiles.key()} {shape} block {block} offset {col_offset}", bias)


def test_quant_tile_entries_parse():
    """A tile table entry names the kernel (`r` for the row kernel) and its six numbers;
    `key` and `parse` are inverse, and a malformed entry is refused by name."""
    for tiles in (quant_gemm.QuantTiles(1, 2, 1024, 8, 2, 1, rows=True),
                  quant_gemm.QuantTiles(16, 32, 128, 4, 4, 8)):
        assert quant_gemm.QuantTiles.parse(tiles.key()) == tiles, tiles.key()
    with pytest.raises(ValueError, match=r"'16/x' is not"):
        quant_gemm.QuantTiles.parse("16/x")


def test_lm_heads_take_the_tensor_core_decode_up_to_two_tokens(monkeypatch):
    """An NVFP4 call goes to `nvfp4_linear` (its tensor-core decode) for an LM head's rows,
    one global and one or two 16-bit tokens on a GPU (`MMA_MAX_TOKENS`; a decode batch
    with `nvfp4_linear.COLUMNS`), and to `nvfp4_gemm_kernel` otherwise: more tokens, fewer
    rows, several globals, float32 or in the interpreter."""
    from types import SimpleNamespace

    from freetoken.kernels import quant_gemm

    monkeypatch.setattr(quant_gemm, "interpreting", lambda: False)
    one = torch.ones(1)

    def takes(tokens, rows=248320, globals_=one, dtype=torch.bfloat16, cuda=True):
        x = SimpleNamespace(shape=(tokens, 2048), is_cuda=cuda, dtype=dtype)
        return quant_gemm._takes_mma(x, rows, globals_)

    assert takes(1) and takes(2) and takes(2, rows=31040)
    assert not any([takes(0), takes(3), takes(16), takes(2, rows=9216),
                    takes(1, globals_=torch.ones(3)), takes(1, dtype=torch.float32),
                    takes(1, cuda=False)])
    monkeypatch.setattr(quant_gemm.nvfp4_linear, "COLUMNS", True)   # tokens as columns
    assert takes(3) and takes(16) and not takes(17)
    monkeypatch.setattr(quant_gemm, "interpreting", lambda: True)
    assert not takes(1)


def test_normed_calls_take_their_own_table_entry(monkeypatch):
    """A one-token call with the input norm fused takes the table's `+norm` entry where the
    table has one, else the plain call's; a call without the norm never takes it."""
    table = {quant_gemm.table_key("fp8", 64, 256, 1): "r1/4/256/4/2/1",
             quant_gemm.table_key("fp8", 64, 256, 1, norm=True): "r1/16/256/4/2/1",
             quant_gemm.table_key("nvfp4", 64, 256, 1): "r1/2/256/4/2/1"}
    assert quant_gemm.table_key("fp8", 64, 256, 1, norm=True) == "fp8/64x256+norm/1"
    monkeypatch.setattr(quant_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(quant_gemm, "_table", lambda: table)
    assert quant_gemm.fusing_tiles(1, 64, 256, "fp8", norm=True).block_n == 16
    assert quant_gemm.fusing_tiles(1, 64, 256, "fp8").block_n == 4
    assert quant_gemm.fusing_tiles(1, 64, 256, "nvfp4", norm=True).block_n == 2
    assert quant_gemm.fusing_tiles(1, 64, 512, "fp8", norm=True) is None


def test_formats_take_their_own_table_entries_before_their_kinds(monkeypatch):
    """Block and per-tensor FP8 share the `fp8` entries but may each have their own
    (`fp8-block/...`): a format's entry before its kind's, the norm's before the plain
    call's, `choose_tiles` of the kind where the table has neither; each FP8 method looks
    its calls up under its own format, apply and apply_fused alike."""
    table = {"fp8/64x256/1": "r1/4/256/4/2/1", "fp8-block/64x256/1": "r1/8/256/4/2/1",
             "fp8/64x256+norm/1": "r1/16/256/4/2/1",
             "fp8-tensor/64x256+norm/1": "r1/32/256/4/2/1"}
    monkeypatch.setattr(quant_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(quant_gemm, "_table", lambda: table)
    assert quant_gemm.tiles_for(1, 64, 256, "fp8-block").block_n == 8
    assert quant_gemm.tiles_for(1, 64, 256, "fp8-tensor").block_n == 4
    assert quant_gemm.tiles_for(1, 64, 256, "fp8").block_n == 4
    assert quant_gemm.tiles_for(1, 64, 256, "fp8-block", norm=True).block_n == 16
    assert quant_gemm.tiles_for(1, 64, 256, "fp8-tensor", norm=True).block_n == 32
    assert quant_gemm.tiles_for(16, 64, 512, "fp8-block") == \
        quant_gemm.choose_tiles(16, 64, 512, "fp8")
    asked = []
    real = quant_gemm.tiles_for
    monkeypatch.setattr(quant_gemm, "interpreting", lambda: True)
    monkeypatch.setattr(quant_gemm, "tiles_for",
                        lambda *a, **k: asked.append(a[3]) or real(*a, **k))
    monkeypatch.setattr(quant_gemm, "serves", lambda x: True)
    block, _ = _block_layer(_gdn_case(1), (16, 16), 0, 1)
    tensor, _ = _tensor_layer(_gdn_case(1), 0, 1, "fp8")
    for layer in (block, tensor):
        layer.quant.apply(layer, _x(2, layer.weight.shape[1], 0))
        layer.quant.apply_fused(layer, _x(1, layer.weight.shape[1], 0),
                                residual=torch.zeros(1, layer.weight.shape[0]))
    assert asked == ["fp8-block"] * 2 + ["fp8-tensor"] * 2, asked


def test_the_shipped_table_spells_every_entry_as_tiles_for_reads_it():
    """Every key of the shipped table is one `table_key` spells for a format the methods
    name (`tile_format`), and every value parses, the row kernel's only at one token (the
    only calls that take them)."""
    from freetoken.kernels.quant_tiles import H200
    from freetoken.layers.quantization.fp8.block_linear import BlockFP8Linear
    from freetoken.layers.quantization.fp8.tensor_linear import FP8TensorLinear
    from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear
    methods = (BlockFP8Linear, FP8TensorLinear, NVFP4Linear)
    formats = {f for m in methods for f in (m.tile_format, quant_gemm.format_kind(m.tile_format))}
    for key, entry in H200.items():
        m = re.fullmatch(r"([a-z0-9-]+)/(\d+)x(\d+)(\+norm)?/(\d+)", key)
        assert m and m[1] in formats, key
        tokens = int(m[5])
        assert key == quant_gemm.table_key(m[1], int(m[2]), int(m[3]), tokens, bool(m[4]))
        tiles = quant_gemm.QuantTiles.parse(entry)
        assert not tiles.rows or tokens == 1, (key, entry)
        assert not m[4] or tiles.rows, f"{key}: a +norm entry must name the row kernel"


def _nvfp4_pair(rows=(20, 13), cols=272):
    """Two segments with their own globals (the second 50x larger): (packed, block scale,
    globals [2], the row-to-global index, the float64 oracle)."""
    a = quantize_nvfp4(_weight(rows[0], cols, 1))
    b = quantize_nvfp4(_weight(rows[1], cols, 2) * 50)
    packed = torch.cat([a.packed, b.packed])
    block_scale = torch.cat([a.block_scale, b.block_scale])
    globals_ = torch.stack([a.global_scale, b.global_scale]).float()
    assert not torch.equal(globals_[0], globals_[1])
    group = torch.tensor([0] * rows[0] + [1] * rows[1], dtype=torch.int32)
    oracle = torch.cat([nvfp4_values(a.packed, a.block_scale, a.global_scale),
                        nvfp4_values(b.packed, b.block_scale, b.global_scale)]).double()
    return packed, block_scale, globals_, group, oracle


@pytest.mark.parametrize("split", [2, 3])
def test_split_inputs_with_bias_follow_the_definition(split):
    """Inputs split over programs (a second launch adds the partial sums and the bias)
    give the same result as the oracle, FP8 and NVFP4."""
    codes, scale = quantize_block(_weight(24, 160, 5), (16, 32))
    x, bias = _x(3, 160, 5), torch.randn(24)
    tiles = quant_gemm.QuantTiles(16, 16, 32, split=split)
    got = quant_gemm.fp8_gemm(x, codes, scale.float(), (torch.arange(24) // 16).int(), 32,
                              bias=bias, tiles=tiles)
    _assert_oracle(got, x, _block_oracle(codes, scale, (16, 32)), f"fp8 split {split}", bias)
    q = quantize_nvfp4(_weight(24, 256, 6))
    got = quant_gemm.nvfp4_gemm(_x(3, 256, 6), q.packed, q.block_scale,
                                q.global_scale.reshape(1), torch.zeros(24, dtype=torch.int32),
                                bias=bias, tiles=quant_gemm.QuantTiles(16, 16, 64, split=split))
    _assert_oracle(got, _x(3, 256, 6), q.dequantize().double(), f"nvfp4 split {split}", bias)


@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("tokens", [1, 16, 33])
def test_nvfp4_kernel_follows_the_definition(reciprocal, tokens):
    """Two segments with their own globals (stored as multipliers, or as the divisors
    compressed-tensors writes) over 272 inputs (a partial step) equal the oracle
    e2m1 * block scale * global, decoded by table lookup."""
    packed, block_scale, globals_, group, oracle = _nvfp4_pair()
    stored = 1.0 / globals_ if reciprocal else globals_
    x = _x(tokens, 272, tokens)
    got = quant_gemm.nvfp4_gemm(x, packed, block_scale, stored, group, reciprocal)
    _assert_oracle(got, x, oracle, f"nvfp4 reciprocal={reciprocal} T={tokens}")


@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("block_n,block_k,split", [(1, 64, 1), (4, 128, 2), (8, 32, 1),
                                                   (2, 512, 1)])
def test_nvfp4_row_kernel_follows_the_definition(reciprocal, block_n, block_k, split):
    """The NVFP4 kernel without tensor cores (`rows` tiles: one token per program) equals
    the oracle for both global conventions, over partial row blocks and a partial last
    step (272 inputs), with the inputs split, steps of 4 to 64 words and a bias."""
    packed, block_scale, globals_, group, oracle = _nvfp4_pair()
    stored = 1.0 / globals_ if reciprocal else globals_
    x, bias = _x(3, 272, block_k), torch.randn(33)
    tiles = quant_gemm.QuantTiles(1, block_n, block_k, split=split, rows=True)
    got = quant_gemm.nvfp4_gemm(x, packed, block_scale, stored, group, reciprocal, bias,
                                tiles)
    _assert_oracle(got, x, oracle, f"nvfp4 rows {tiles.key()} reciprocal={reciprocal}", bias)


def _fusion_call(split, offset, with_bias=False, fmt="fp8", gated=False, **change):
    """(the `fmt` row kernel's result with the input norm, the stored normalised x and the
    residual (as large as the product), `gated`: of [gate | up] halves of the 40 rows, the
    float64 oracle of those steps from `gemv.reference_norm`, the kernel's normalised x,
    the reference's); `change` replaces arguments of the call (a bug)."""
    cols = 208 if fmt == "nvfp4" else 200
    x = _x(2, cols, 7) * 3
    norm = gemv.Norm(torch.randn(cols, generator=torch.Generator().manual_seed(3)) * 0.3,
                     1e-6, offset)
    if fmt == "nvfp4":
        packed, block_scale, globals_, group, oracle = _nvfp4_pair((27, 13), cols)
        args = dict(packed=packed, block_scale=block_scale, global_scale=globals_,
                    group=group)
    else:
        codes, scale = quantize_block(_weight(40, cols + 8, 7), (16, 24))
        codes = codes[:, 8:].contiguous()
        oracle = _block_oracle(codes, scale, (16, 24), 0, 8)
        args = dict(weight=codes, scale=scale.float(), scale_row=(torch.arange(40) // 16).int(),
                    block_cols=24, col_offset=8)
    want_normed = gemv.reference_norm(x, norm)
    want = want_normed.double() @ oracle.T
    bias = torch.randn(40) if with_bias else None
    if bias is not None:
        want = want + bias.double()
    if gated:
        want = torch.nn.functional.silu(want[:, :20]) * want[:, 20:]
    residual = (torch.randn(*want.shape, generator=torch.Generator().manual_seed(4))
                * float(want.abs().mean()))
    normed = torch.empty_like(x)
    args.update(x=x, bias=bias, norm=norm, residual=residual, normed=normed, gated=gated,
                tiles=quant_gemm.QuantTiles(1, 8, 64, split=split, rows=True))
    gemm = quant_gemm.nvfp4_gemm if fmt == "nvfp4" else quant_gemm.fp8_gemm
    got = gemm(**dict(args, **change))
    return got, want + residual.double(), normed, want_normed


# The gated cases' gates reach -1e4: the interpreter's sigmoid saturates through exp's overflow.
SIGMOID_SATURATES = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("split", [1, 2], ids=["one-launch", "split"])
@pytest.mark.parametrize("offset,gated,early", [(False, False, True), (True, False, True),
                                                (True, True, True), (True, True, False)],
                         ids=["w", "1+w", "1+w-gated", "1+w-gated-late"])
@SIGMOID_SATURATES
def test_row_kernels_take_the_norm_and_the_residual(fmt, split, offset, gated, early,
                                                    monkeypatch):
    """The FP8 and NVFP4 row kernels with the decode step's fusions: the RMSNorm (weight w,
    or Qwen3.5's 1 + w) applied as x is loaded and stored for the layers after it, a bias,
    SiLU-and-mul of a [gate | up] weight (the up half with its own scales and globals),
    and the residual added after the rounding (after a split, the reduction launch gates
    and adds), loaded first or where it is added (`gemv.ROW_EARLY`, "late"): equal to the
    oracle of the separate steps, and the stored normalised x to `reference_norm`."""
    monkeypatch.setattr(gemv, "ROW_EARLY", early)
    got, want, normed, want_normed = _fusion_call(split, offset, with_bias=True, fmt=fmt,
                                                  gated=gated)
    err = float((got.double() - want).norm() / want.norm())
    assert err < RTOL, f"{fmt} split {split} offset {offset}: relative L2 {err:.2e}"
    torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("block_n,block_k", [(32, 256), (16, 64)])
def test_wide_normed_programs_take_the_norm_too(fmt, block_n, block_k):
    """The tile table's widest normed programs (32 or 16 rows a program, as GatedDeltaNet's
    in_proj and attention's qkv take with the norm fused): over 40 rows (a partial second
    program) and in one whole-row step or several, the same oracle of the separate steps."""
    tiles = quant_gemm.QuantTiles(1, block_n, block_k, num_stages=2, rows=True)
    got, want, normed, want_normed = _fusion_call(1, True, fmt=fmt, tiles=tiles)
    err = float((got.double() - want).norm() / want.norm())
    assert err < RTOL, f"{fmt} {tiles.key()}: relative L2 {err:.2e}"
    torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("bug", ["norm dropped", "residual dropped", "plain norm for 1+w",
                                 "gate's scales for up"])
@SIGMOID_SATURATES
def test_fusion_bugs_are_caught(fmt, bug):
    """A launch that skips the norm, the residual, applies w where Qwen3.5 scales by
    1 + w, or scales the up half with the gate half's scales fails the comparison."""
    change = {"norm dropped": dict(norm=None, normed=None),
              "residual dropped": dict(residual=None)}.get(bug, {})
    gated = bug == "gate's scales for up"
    if gated:
        change = _gate_scales_for_up(fmt)
    got, want, _, _ = _fusion_call(1, True, fmt=fmt, gated=gated, **change)
    if bug == "plain norm for 1+w":
        got, _, _, _ = _fusion_call(1, False, fmt=fmt)
    err = float((got.double() - want).norm() / want.norm())
    assert err > 1e-2, f"{fmt} {bug}: relative L2 {err:.2e} passes"


def _gate_scales_for_up(fmt) -> dict:
    """`_fusion_call` arguments whose up rows read the gate rows' scales (FP8: scale rows;
    NVFP4: block scales and globals)."""
    if fmt == "fp8":
        return dict(scale_row=(torch.arange(40) % 20 // 16).int())
    _, block_scale, _, group, _ = _nvfp4_pair((27, 13), 208)
    return dict(block_scale=torch.cat([block_scale[:20], block_scale[:20]]),
                group=torch.cat([group[:20], group[:20]]))


def test_fusions_need_the_row_kernel():
    """The norm and residual are refused on tensor-core tiles and where their shapes do
    not fit, naming the tensor."""
    codes, scale = quantize_block(_weight(16, 32, 0), (16, 16))
    rows = torch.zeros(16, dtype=torch.int32)
    norm = gemv.Norm(torch.ones(32), 1e-6, False)
    with pytest.raises(ValueError, match="run on the row kernel"):
        quant_gemm.fp8_gemm(_x(2, 32, 0), codes, scale, rows, 16, norm=norm,
                            tiles=quant_gemm.QuantTiles(16, 16, 32))
    row_tiles = quant_gemm.QuantTiles(1, 4, 32, rows=True)
    with pytest.raises(ValueError, match=r"residual \(2, 15\)"):
        quant_gemm.fp8_gemm(_x(2, 32, 0), codes, scale, rows, 16, tiles=row_tiles,
                            residual=torch.zeros(2, 15))
    with pytest.raises(ValueError, match=r"normed \(2, 32\).*norm given: False"):
        quant_gemm.fp8_gemm(_x(2, 32, 0), codes, scale, rows, 16, tiles=row_tiles,
                            normed=torch.zeros(2, 32))
    with pytest.raises(ValueError, match=r"norm weight \(31,\)"):
        quant_gemm.fp8_gemm(_x(2, 32, 0), codes, scale, rows, 16, tiles=row_tiles,
                            norm=gemv.Norm(torch.ones(31), 1e-6, False))
    q = quantize_nvfp4(_weight(16, 32, 0))
    nvfp4 = (q.packed, q.block_scale, q.global_scale.reshape(1), rows)
    with pytest.raises(ValueError, match="nvfp4_gemm: the norm, gate and residual fusions run on"):
        quant_gemm.nvfp4_gemm(_x(2, 32, 0), *nvfp4, norm=norm,
                              tiles=quant_gemm.QuantTiles(16, 16, 32))
    with pytest.raises(ValueError, match=r"nvfp4_gemm: residual \(2, 15\)"):
        quant_gemm.nvfp4_gemm(_x(2, 32, 0), *nvfp4, tiles=row_tiles,
                              residual=torch.zeros(2, 15))


def test_bad_inputs_are_refused_naming_the_mismatch():
    """Shapes, dtypes and index buffers that do not fit are refused with the sizes."""
    codes, scale = quantize_block(_weight(16, 32, 0), (16, 16))
    rows = torch.zeros(16, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit the weight"):
        quant_gemm.fp8_gemm(_x(2, 48, 0), codes, scale, rows, 16)
    with pytest.raises(ValueError, match=r"int32 \[16\]"):
        quant_gemm.fp8_gemm(_x(2, 32, 0), codes, scale, rows[:8], 16)
    with pytest.raises(ValueError, match="float8_e4m3fn and scale float32"):
        quant_gemm.fp8_gemm(_x(2, 32, 0), codes.float(), scale, rows, 16)
    q = quantize_nvfp4(_weight(16, 64, 0))
    with pytest.raises(ValueError, match="not an NVFP4 weight"):
        quant_gemm.nvfp4_gemm(_x(2, 64, 0), q.packed, q.block_scale[:, :2],
                              q.global_scale.reshape(1), rows)


# -- the linear methods, every rank ------------------------------------------------------------

class _Layer(nn.Module):
    def __init__(self, method, local_in: int, local_out: int):
        super().__init__()
        self.quant = method
        method.create_weights(self, local_in, local_out)


def _chunk(full: torch.Tensor, split: Split, rank: int, size: int, dim: int = 0):
    """Rank `rank`'s part of `split` (a segment of `full` from `split.start`) along `dim`."""
    local = split.local(size)
    heads = split.heads if split.heads is not None and split.heads < size else size
    first = split.start + (rank * heads // size) * local
    return full.narrow(dim, first, local)


@dataclasses.dataclass
class _Case:
    """A fused layer: its output segments (`Split`s, each naming its checkpoint tensor
    `group`), each checkpoint tensor's full float weight, the full inputs, and whether the
    inputs are split (row-parallel)."""

    segments: tuple[Split, ...]
    tensors: tuple[torch.Tensor, ...]
    in_features: int
    row_parallel: bool = False

    def cols(self) -> Split:
        return Split(self.in_features) if self.row_parallel else Split.whole(self.in_features)


def _gdn_case(seed: int) -> _Case:
    """[q 32 | k 32 | v 64] of one tensor + z 64 of another, 48 inputs: with 16 x 16 blocks
    the segments' rank shares are 4-16 rows (sub-block at TP 4 and 8)."""
    qkv, z = _weight(128, 48, seed), _weight(64, 48, seed + 1) * 30
    return _Case((Split(32, start=0, total=128, group=0), Split(32, start=32, total=128,
                                                                group=0),
                  Split(64, start=64, total=128, group=0), Split(64, group=1)), (qkv, z), 48)


def _kv_case(seed: int) -> _Case:
    """q 64 rows (8 heads of 8) + k, v one head each of 2 KV heads (replicated past TP 2),
    three tensors of different magnitude."""
    return _Case((Split(64, group=0), Split(16, heads=2, group=1), Split(16, heads=2, group=2)),
                 (_weight(64, 32, seed), _weight(16, 32, seed + 1) * 10,
                  _weight(16, 32, seed + 2) * 0.1), 32)


def _row_case(seed: int) -> _Case:
    """A row-parallel 40 x 256 weight (32 inputs per rank at TP 8: two ranks per 64-block)."""
    return _Case((Split.whole(40),), (_weight(40, 256, seed),), 256, row_parallel=True)


def _straddle_case(seed: int) -> _Case:
    """A row-parallel 40 x 240 weight: in 16-blocks each rank's 30 / 60 / 120 inputs start
    inside a block and straddle the next ones."""
    return _Case((Split.whole(40),), (_weight(40, 240, seed),), 240, row_parallel=True)


def _rank_rows(case: _Case, rank: int, size: int) -> list[torch.Tensor]:
    """Each segment's rows on `rank` of each tensor (inputs cut when row-parallel)."""
    out = []
    for seg in case.segments:
        full = case.tensors[seg.group or 0]
        rows = full if case.row_parallel else _chunk(full, seg, rank, size)
        out.append(_chunk(rows, case.cols(), rank, size, dim=1) if case.row_parallel else rows)
    return out


def _block_layer(case: _Case, block, rank: int, size: int) -> tuple[_Layer, torch.Tensor]:
    """The block-FP8 layer of `rank`, loaded as the loader does (the weight rows of each
    segment, its scale through the method's own `BlockScaleSplit`s), and its float64
    oracle weight."""
    fmt = ModuleFormat(FP8_BLOCK, HF_FP8, block)
    method = method_for(fmt, list(case.segments), case.cols(), rank, size)
    quantized = [quantize_block(t, block) for t in case.tensors]
    weights, scales, oracle = [], [], []
    for seg, spec in zip(case.segments, method.rows):
        codes, scale = quantized[seg.group or 0]
        split = Split.whole(codes.shape[0]) if case.row_parallel else seg
        rows = _chunk(codes, split, rank, size)
        row_first = 0 if case.row_parallel else split.start + \
            (rank * (split.heads if split.heads and split.heads < size else size) // size) \
            * split.local(size)
        full64 = _block_oracle(codes, scale, block)
        part = full64.narrow(0, row_first, rows.shape[0])
        if case.row_parallel:
            rows = _chunk(rows, case.cols(), rank, size, dim=1)
            part = _chunk(part, case.cols(), rank, size, dim=1)
            scale = method.cols.shard(scale, rank, size)
        weights.append(rows)
        scales.append(spec.shard(scale, rank, size) if not case.row_parallel else scale)
        oracle.append(part)
    layer = _Layer(method, weights[0].shape[1], sum(w.shape[0] for w in weights))
    layer.weight.copy_(torch.cat(weights))
    layer.weight_scale.copy_(torch.cat(scales).float())
    return layer, torch.cat(oracle)


def _tensor_layer(case: _Case, rank: int, size: int, fmt: str):
    """The FP8-per-tensor or NVFP4 layer of `rank` (per-tensor scales replicated, one per
    checkpoint tensor) and its float64 oracle weight."""
    rows = _rank_rows(case, rank, size)
    cols = rows[0].shape[1]
    if fmt == "fp8":
        method = method_for(ModuleFormat(FP8_TENSOR, MODELOPT), list(case.segments),
                            case.cols(), rank, size)
        per_tensor = [quantize_per_tensor(t) for t in case.tensors]
        layer = _Layer(method, cols, sum(r.shape[0] for r in rows))
        codes = torch.cat([_rank_rows(dataclasses.replace(case, tensors=tuple(
            c.float() for c, _ in per_tensor)), rank, size)[i].to(torch.float8_e4m3fn)
            for i in range(len(rows))])
        layer.weight.copy_(codes)
        layer.weight_scale.copy_(torch.stack([s for _, s in per_tensor]))
        layer.input_scale.fill_(0.5)
        groups = [seg.group or 0 for seg in case.segments]
        oracle = codes.double() * torch.repeat_interleave(
            layer.weight_scale.double()[groups], torch.tensor([r.shape[0] for r in rows]))[:, None]
        return layer, oracle
    reciprocal = fmt == "nvfp4-ct"
    method = method_for(ModuleFormat(NVFP4, COMPRESSED_TENSORS if reciprocal else MODELOPT),
                        list(case.segments), case.cols(), rank, size)
    quantized = [quantize_nvfp4(t) for t in case.tensors]
    layer = _Layer(method, cols, sum(r.shape[0] for r in rows))
    parts = []
    for seg in case.segments:
        q = quantized[seg.group or 0]
        split = Split.whole(q.packed.shape[0]) if case.row_parallel else seg
        packed, block_scale = _chunk(q.packed, split, rank, size), _chunk(q.block_scale, split,
                                                                          rank, size)
        if case.row_parallel:
            packed = _chunk(packed, Split(case.in_features // 2), rank, size, dim=1)
            block_scale = _chunk(block_scale, Split(case.in_features // 16), rank, size, dim=1)
        parts.append((packed, block_scale, q.global_scale))
    layer.weight.copy_(torch.cat([p for p, _, _ in parts]))
    layer.weight_scale.copy_(torch.cat([s for _, s, _ in parts]))
    globals_ = torch.stack([q.global_scale for q in quantized]).float()
    layer.weight_scale_2.copy_(1.0 / globals_ if reciprocal else globals_)
    oracle = torch.cat([nvfp4_values(p, s, g) for p, s, g in parts]).double()
    return layer, oracle


def _every_rank(size: int):
    return range(size)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_block_fp8_methods_at_every_rank(tp):
    """The fused GatedDeltaNet-like layer (segments inside blocks, ranks sharing blocks) and
    the row-parallel layers (ranks sharing a 64-block; ranks straddling 16-blocks):
    each rank's kernel result equals the oracle on that rank's rows and inputs."""
    for rank in _every_rank(tp):
        for case, block in ((_gdn_case(tp), (16, 16)), (_row_case(tp), (16, 64)),
                            (_straddle_case(tp), (16, 16))):
            layer, oracle = _block_layer(case, block, rank, tp)
            x = _x(3, layer.weight.shape[1], rank)
            _assert_oracle(layer.quant.kernel(layer, x, None), x, oracle,
                           f"block FP8 {block} tp={tp} rank={rank} "
                           f"{'row' if case.row_parallel else 'column'}-parallel")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "nvfp4-ct"])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_per_tensor_scale_methods_at_every_rank(fmt, tp):
    """FP8 per tensor and NVFP4 (both conventions) with a different scale or global for
    each checkpoint tensor of a fused layer (q | k | v with KV heads replicated past TP 2;
    GatedDeltaNet's [q | k | v] sharing one, z its own) and a row-parallel layer: each
    rank's kernel result equals the oracle."""
    cases = [_kv_case(tp), _gdn_case(tp)] + ([_row_case(tp)] if fmt == "fp8" else
                                              [_Case((Split.whole(40),),
                                                     (_weight(40, 256, tp),), 256, True)])
    for rank in _every_rank(tp):
        for case in cases:
            layer, oracle = _tensor_layer(case, rank, tp, fmt)
            x = _x(2, oracle.shape[1], rank)
            _assert_oracle(layer.quant.kernel(layer, x, None), x, oracle,
                           f"{fmt} tp={tp} rank={rank} segments={len(case.segments)}")


def test_apply_routes_through_the_kernel_with_leading_dims_and_bias(monkeypatch):
    """Where `quant_gemm.serves` says yes (CUDA; here forced), a method's `apply` gives the
    kernel's result for x [2, 3, in] plus a bias, shaped like F.linear's; where it says no,
    the torch path's. Both equal the oracle."""
    layer, oracle = _block_layer(_gdn_case(3), (16, 16), 1, 4)
    x, bias = _x(6, 48, 3).reshape(2, 3, 48), torch.randn(layer.weight.shape[0])
    want = layer.quant.apply(layer, x, bias)
    monkeypatch.setattr(quant_gemm, "serves", lambda x: True)
    got = layer.quant.apply(layer, x, bias)
    assert got.shape == want.shape == (2, 3, layer.weight.shape[0])
    _assert_oracle(got.reshape(6, -1), x.reshape(6, -1), oracle, "apply (kernel)", bias)
    _assert_oracle(want.reshape(6, -1), x.reshape(6, -1), oracle, "apply (torch)", bias)


def test_the_norm_switch_leaves_the_norm_to_the_caller(monkeypatch):
    """With `quant_gemm.DECODE_NORM` off a one-token call with the input norm is left to
    the caller's unfused steps (None) while the residual still fuses; on, both fuse."""
    layer, _ = _block_layer(_gdn_case(1), (16, 16), 0, 1)
    x = _x(1, layer.weight.shape[1], 0)
    norm = gemv.Norm(torch.ones(x.shape[1]), 1e-6, False)
    residual = torch.zeros(1, layer.weight.shape[0])
    monkeypatch.setattr(quant_gemm, "serves", lambda x: True)
    monkeypatch.setattr(quant_gemm, "fusing_tiles",
                        lambda *a, **k: quant_gemm.QuantTiles(1, 4, 32, rows=True))
    assert layer.quant.apply_fused(layer, x, norm=norm) is not None
    monkeypatch.setattr(quant_gemm, "DECODE_NORM", False)
    assert layer.quant.apply_fused(layer, x, norm=norm) is None
    assert layer.quant.apply_fused(layer, x, residual=residual) is not None


def test_the_environment_switch_turns_the_kernels_off(monkeypatch):
    """FREETOKEN_QUANT_KERNELS=0 makes `serves` say no, whatever the device."""
    quant_gemm.enabled.cache_clear()
    monkeypatch.setenv("FREETOKEN_QUANT_KERNELS", "0")
    try:
        assert not quant_gemm.enabled() and not quant_gemm.serves(torch.zeros(1, 16))
    finally:
        quant_gemm.enabled.cache_clear()


# -- injected bugs -----------------------------------------------------------------------------

def _first_segment_rows(layer):
    """Bug: every segment reads its rows' scales from the first segment's scale rows (as if
    one segment's scale were written for all)."""
    method, first, at = layer.quant, 0, 0
    for seg in method.rows:
        rows = seg.full_size // (seg.heads if seg.heads and seg.heads < method.tp_size
                                 else method.tp_size)
        layer.weight_scale_row[at:at + rows] -= first
        first, at = first + seg.blocks(method.tp_size), at + rows


def _offset_dropped(layer):
    """Bug: the shard's offset inside its first column block ignored (read from 0)."""
    layer.quant = dataclasses.replace(layer.quant,
                                      cols=dataclasses.replace(layer.quant.cols, heads=1))


@pytest.mark.parametrize("bug,case", [(_first_segment_rows, _gdn_case),
                                      (_offset_dropped, _straddle_case)])
def test_the_oracle_comparison_catches_block_fp8_bugs(bug, case):
    """With each bug injected into the TP 8 rank 1 layer, the comparison fails."""
    layer, oracle = _block_layer(case(8), (16, 16), 1, 8)
    x = _x(3, layer.weight.shape[1], 1)
    _assert_oracle(layer.quant.kernel(layer, x, None), x, oracle, "before the bug")
    bug(layer)
    with pytest.raises(AssertionError, match="relative L2 error"):
        _assert_oracle(layer.quant.kernel(layer, x, None), x, oracle, bug.__name__)


@pytest.mark.parametrize("bug", ["divisor as multiplier", "one global for all"])
def test_the_oracle_comparison_catches_global_scale_bugs(bug):
    """A compressed-tensors global used as a multiplier, or segment 0's global used for
    every segment, fails the comparison."""
    layer, oracle = _tensor_layer(_kv_case(2), 1, 2, "nvfp4-ct")
    x = _x(3, oracle.shape[1], 1)
    if bug == "divisor as multiplier":
        object.__setattr__(layer.quant, "reciprocal", False)
    else:
        layer.weight_scale_2_group.zero_()
    with pytest.raises(AssertionError, match="relative L2 error"):
        _assert_oracle(layer.quant.kernel(layer, x, None), x, oracle, bug)
