"""Block FP8 (freetoken.formats.fp8): the dequantizer follows the format definition (a
float64 oracle indexing each element's block, partial last blocks included), and the block
scales split across TP 1/2/4/8 so that each rank's shard dequantizes bitwise to its rows or
columns of the full weight, two ranks sharing a block where a slice is smaller than or
straddles one; shard and unshard are bitwise inverses, fp8 bytes included."""

from __future__ import annotations

import pytest
import torch

from freetoken.formats.fp8.block import BlockFP8FormatError, dequantize, quantize, scale_grid
from freetoken.formats.fp8.specs import BlockScaleSplit
from freetoken.formats.shard import ShardError, write_pieces
from freetoken.formats.specs import Heads, Split

TP_SIZES = (1, 2, 4, 8)


def _make_weight(rows: int, cols: int, block: tuple[int, int], seed: int = 0,
                 scale_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude, so a scale read from the wrong block shows.
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)
    return quantize(w, block, scale_dtype)


def _oracle(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    rows = torch.arange(weight.shape[0]) // block[0]
    cols = torch.arange(weight.shape[1]) // block[1]
    return weight.double() * scale.double()[rows][:, cols]


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{label}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}")
    same = got.contiguous().view(torch.uint8).equal(want.contiguous().view(torch.uint8))
    worst = (got.double() - want.double()).abs().max()
    assert same, f"{label}: not bitwise equal (max abs {worst})"


@pytest.mark.parametrize("shape,block", [((40, 48), (16, 16)), ((37, 20), (16, 8)),
                                         ((64, 64), (32, 32))])
def test_dequantize_follows_the_definition(shape, block):
    """dequantize equals the float64 oracle (each element times its own block's scale,
    partial last blocks too) in float64 and to float32 rounding; the quantizer's round
    trip is within e4m3's relative step (2^-3) of the original."""
    weight, scale = _make_weight(*shape, block)
    assert tuple(scale.shape) == scale_grid(shape, block)
    _assert_bitwise(dequantize(weight, scale, block, dtype=torch.float64),
                    _oracle(weight, scale, block), "float64")
    torch.testing.assert_close(dequantize(weight, scale, block), _oracle(weight, scale, block)
                               .float(), rtol=2 ** -23, atol=0)


def _shard_all(spec, weight_spec, weight, scale, size, name):
    return ([weight_spec.shard(weight, r, size, name) for r in range(size)],
            [spec.shard(scale, r, size, name) for r in range(size)])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,full", [(0, 40), (1, 40), (0, 48), (1, 64)])
def test_each_rank_dequantizes_exactly_its_slice(dim, full, scale_dtype):
    """At TP 1/2/4/8 with blocks of 16 (TP 8 on 40 gives 5 per rank: ranks share blocks and
    the last block is partial), rank r's fp8 shard and scale shard, dequantized with the
    spec's offset, are bitwise rows (dim 0) or columns (dim 1) of the full dequantized
    weight; `pieces` writes the same bytes as `shard`; unshard restores the full fp8 weight
    and scale bitwise."""
    block = (16, 16)
    shape = (full, 24) if dim == 0 else (24, full)
    weight, scale = _make_weight(*shape, block, scale_dtype=scale_dtype)
    whole = dequantize(weight, scale, block)
    spec, weight_spec = BlockScaleSplit(dim, 16, full), Split(dim)
    for size in TP_SIZES:
        weights, scales = _shard_all(spec, weight_spec, weight, scale, size, "w.weight_scale_inv")
        step = full // size
        for r in range(size):
            offset = (spec.offset(r, size), 0) if dim == 0 else (0, spec.offset(r, size))
            local = dequantize(weights[r], scales[r], block, offset)
            _assert_bitwise(local, whole.narrow(dim, r * step, step), f"tp={size} rank {r}")
            out = torch.full_like(scales[r], float("nan"))
            write_pieces(spec.pieces(scale, r, size), out)
            _assert_bitwise(out, scales[r], f"tp={size} rank {r} pieces")
        _assert_bitwise(weight_spec.unshard(weights), weight, f"tp={size} fp8 weight")
        _assert_bitwise(spec.unshard(scales), scale, f"tp={size} scale")


def test_replicated_kv_heads_take_their_heads_blocks():
    """k_proj with 2 KV heads of 24 rows (blocks of 16: head 1 starts 8 rows into block 1)
    at TP 4 and 8: each rank holds its head's scale rows and dequantizes to that head."""
    block, heads, head_rows = (16, 16), 2, 24
    weight, scale = _make_weight(heads * head_rows, 32, block)
    whole = dequantize(weight, scale, block)
    spec = BlockScaleSplit(0, 16, heads * head_rows, heads=heads)
    for size in (4, 8):
        weights, scales = _shard_all(spec, Heads(heads), weight, scale, size, "k.weight_scale")
        for r in range(size):
            head = r * heads // size
            local = dequantize(weights[r], scales[r], block, (spec.offset(r, size), 0))
            _assert_bitwise(local, whole[head * head_rows:(head + 1) * head_rows],
                            f"tp={size} rank {r}")
        _assert_bitwise(spec.unshard(scales), scale, f"tp={size} scale")


def test_unsplittable_layouts_and_wrong_scales_are_refused():
    """A weight dim the TP size does not divide is refused naming the tensor, dim and TP
    size; a scale whose grid does not match the weight is refused naming it; a scale too
    small for the weight is refused by the dequantizer."""
    spec = BlockScaleSplit(1, 16, 40)
    with pytest.raises(ShardError, match=r"down.weight_scale_inv: weight dim 1 of 40 cannot "
                                         r"be split across tp_size=3"):
        spec.shard(torch.ones(4, 3), 0, 3, "down.weight_scale_inv")
    with pytest.raises(ShardError, match=r"down.weight_scale_inv: block scale of shape "
                                         r"\(4, 2\).*needs 3 along dim 1"):
        spec.shard(torch.ones(4, 2), 0, 2, "down.weight_scale_inv")
    weight, scale = _make_weight(40, 24, (16, 16))
    with pytest.raises(BlockFP8FormatError, match="q.weight: dim 0 has 40 elements"):
        dequantize(weight, scale[:2], (16, 16), name="q.weight")


def test_packed_segments_and_interleaved_heads_move_scales_with_their_rows():
    """GDN in_proj_qkv-like packing [q 40 | k 40 | v 56] with blocks of 16 (k starts mid-
    block) split per segment, and q_proj-like per-head [q_h | gate_h] rows (4 heads of 12
    rows) with its scale expanded to one row per weight row: at TP 1/2/4 each rank's shard
    dequantizes bitwise to its rows of the full dequantized weight, pieces equal shard, and
    unshard restores the scale bitwise."""
    from freetoken.formats.fp8.interleaved import InterleavedBlockRows
    from freetoken.formats.fp8.specs import BlockScaleSegments
    from freetoken.formats.specs import InterleavedHeads, Segments

    block, sizes = (16, 16), (40, 40, 56)
    weight, scale = _make_weight(sum(sizes), 32, block)
    whole = dequantize(weight, scale, block)
    starts = (0, 40, 80)
    spec = BlockScaleSegments(tuple(BlockScaleSplit(0, 16, n, start=s, total=sum(sizes))
                                    for n, s in zip(sizes, starts)))
    for size in (1, 2, 4):
        w_parts = [Segments(sizes).shard(weight, r, size) for r in range(size)]
        s_parts = [spec.shard(scale, r, size) for r in range(size)]
        for r in range(size):
            local, row, at = [], 0, 0
            for seg in spec.segments:
                n, blocks = seg.full_size // size, seg.blocks(size)
                local.append(dequantize(w_parts[r][row:row + n], s_parts[r][at:at + blocks],
                                        block, (seg.offset(r, size), 0)))
                row, at = row + n, at + blocks
            want = Segments(sizes).shard(whole, r, size)
            _assert_bitwise(torch.cat(local), want, f"segments tp={size} rank {r}")
            out = torch.full_like(s_parts[r], float("nan"))
            write_pieces(spec.pieces(scale, r, size), out)
            _assert_bitwise(out, s_parts[r], f"segments tp={size} rank {r} pieces")
        _assert_bitwise(spec.unshard(s_parts), scale, f"segments tp={size} unshard")
    weight, scale = _make_weight(4 * 2 * 12, 32, block)
    whole, heads = dequantize(weight, scale, block), InterleavedHeads(4)
    spec = InterleavedBlockRows(16, 96, 4)
    for size in (1, 2, 4):
        s_parts = [spec.shard(scale, r, size) for r in range(size)]
        for r in range(size):
            local = dequantize(heads.shard(weight, r, size), s_parts[r], (1, 16))
            _assert_bitwise(local, heads.shard(whole, r, size), f"q|gate tp={size} rank {r}")
            out = torch.full_like(s_parts[r], float("nan"))
            write_pieces(spec.pieces(scale, r, size), out)
            _assert_bitwise(out, s_parts[r], f"q|gate tp={size} rank {r} pieces")
        _assert_bitwise(spec.unshard(s_parts), scale, f"q|gate tp={size} unshard")
