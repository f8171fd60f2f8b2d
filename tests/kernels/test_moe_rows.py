"""The one-token routed experts on the row kernels (`freetoken.kernels.moe_rows`, taken by
`fused_moe.fused_moe` at one token) in Triton's interpreter, against the per-expert torch
loop (`fused_moe.reference_moe`):

- 16-bit and float32 experts (bf16 to bf16's precision: the reference rounds each expert's
  output, the kernels only the sum), whole and ragged feature blocks and input steps, expert
  ids in any order, the slots summed (`sum_slots`) and each slot alone;
- block-FP8 experts of TP ranks that start inside a shared column block, the scale applied
  to every element (24 x 40 blocks) and once per input step (64-input column blocks, the
  rank 32 inputs into its block);
- the launcher takes the row kernels at one token only, and not when grouped tiles are
  named; the default tiles' policy;
- the MoE block's shared expert and its sigmoid gate as one more slot of the same two
  launches (`fused_moe(shared=...)`), its intermediate size equal to, larger or smaller
  than the routed one, against `reference_moe_shared`; refused where it cannot join;
- the decoder layer's residual added in the down launch (`fused_moe(residual=...)`), with
  and without the shared expert; refused where it cannot join;
- injected bugs the comparison must catch: the routing weight dropped, gate/up reading the
  previous slot's expert, the down projection's column offset dropped, the shared expert
  added ungated or with its gate rows for its up rows, the residual left out."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from interpreted import (
    LaunchRecorder,
    interpreter,  # noqa: F401  (module-wide fixture)
)
from interpreted import assert_close as _assert_close

from freetoken.distributed import TPInfo, acting_as
from freetoken.formats.quant.format import FP8_BLOCK, HF_FP8, ModuleFormat
from freetoken.kernels import fused_moe, moe_rows
from freetoken.kernels.moe_rows import RowMoeTiles, SharedExpertRows
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken_verify.checks.kernels.quant import fill
from freetoken_verify.checks.kernels.quant_data import experts_data
from freetoken_verify.checks.quant_layout import Experts

STEP_TILES = RowMoeTiles(gate_up_n=32, down_n=64, block_k=64)
"""Whole shapes in several input steps each."""
SMALL_TILES = RowMoeTiles(gate_up_n=4, down_n=8, block_k=64)
"""Several input steps and feature blocks over the small shapes, ragged at their ends."""
PARTIAL = (Experts(experts=6, top_k=2, hidden=112, intermediate=128), (24, 40))
GROUPED = (Experts(experts=8, top_k=4, hidden=192, intermediate=192), (32, 64))
"""At TP 2 rank 1 holds I = 96 from input 96: 32 inputs into its 64-wide column block."""


def _make_experts(experts, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _make_token(experts, top_k, hidden, dtype, seed, shuffle=False):
    """One token, its routing weights and expert ids (top-k order, or shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen)
    weights, ids = torch.softmax(torch.randn(1, experts, generator=gen), -1).topk(top_k)
    if shuffle:
        order = torch.randperm(top_k, generator=gen)
        weights, ids = weights[:, order], ids[:, order]
    return x.to(dtype), (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


def _assert_matches(got, want, what):
    """float32: the interpreted tests' closeness; bf16: within a few bf16 roundings."""
    if want.dtype == torch.bfloat16:
        atol = 2e-2 * float(want.abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=atol,
                                   msg=lambda m: f"{what}: {m}")
    else:
        _assert_close(got, want, what)


def _assert_experts(x, weights, ids, w13, w2, what, tiles=None, **scales):
    """Summed and per-slot outputs of the row path equal the reference (on `ref`, the
    rank's exact (w13, w2) in float32, when the experts are block FP8)."""
    ref_w13, ref_w2 = scales.pop("ref", (w13, w2))
    got = fused_moe.fused_moe(x, weights, ids, w13, w2, tiles=tiles, **scales)
    _assert_matches(got, fused_moe.reference_moe(x, weights, ids, ref_w13, ref_w2),
                    f"{what} summed")
    slots = fused_moe.fused_moe(x, weights, ids, w13, w2, tiles=tiles, sum_slots=False,
                                **scales)
    assert slots.shape == (1, ids.shape[1], x.shape[1]) and slots.dtype == torch.float32, \
        f"{what}: slots {tuple(slots.shape)} {slots.dtype}"
    for s in range(ids.shape[1]):
        want = fused_moe.reference_moe(x, weights[:, s:s + 1], ids[:, s:s + 1], ref_w13, ref_w2)
        _assert_matches(slots[:, s].to(x.dtype), want, f"{what} slot {s}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, tiles", [((16, 8, 256, 128), STEP_TILES),
                                          ((8, 3, 100, 40), SMALL_TILES)],
                         ids=["whole", "ragged"])
def test_row_path_matches_reference(dtype, shape, tiles):
    """One token's weighted expert sum, and each slot alone, over 16 experts of 256 x 128
    (whole tiles) and 8 of 100 x 40 (every dim ragged), with the interpreter's default
    tiles (one step over each row) and with smaller ones (several input steps, and over the
    ragged shape several feature blocks, partial at the ends)."""
    experts, top_k, hidden, inter = shape
    w13, w2 = _make_experts(experts, hidden, inter, dtype, seed=hidden)
    x, weights, ids = _make_token(experts, top_k, hidden, dtype, seed=inter)
    _assert_experts(x, weights, ids, w13, w2, f"{dtype} {shape}")
    _assert_experts(x, weights, ids, w13, w2, f"{dtype} {shape} {tiles}", tiles)


def test_expert_ids_in_any_order():
    """Slots need not be in top-k order: shuffled slots give the reference's sum, and the
    same sum as the sorted slots; a launch repeated gives the same bits (fixed order)."""
    w13, w2 = _make_experts(12, 64, 32, torch.float32, seed=3)
    x, weights, ids = _make_token(12, 6, 64, torch.float32, seed=4, shuffle=True)
    assert not torch.equal(weights, weights.sort(descending=True).values), "not shuffled"
    got = fused_moe.fused_moe(x, weights, ids, w13, w2)
    _assert_close(got, fused_moe.reference_moe(x, weights, ids, w13, w2), "shuffled")
    order = weights.argsort(descending=True)
    _assert_close(got, fused_moe.fused_moe(x, weights[:, order[0]], ids[:, order[0]], w13, w2),
                  "shuffled vs sorted")
    assert torch.equal(got, fused_moe.fused_moe(x, weights, ids, w13, w2)), "repeat differs"


def _make_fp8(layout, tp, rank, seed):
    """(rank `rank` of TP `tp`'s block-FP8 experts, their block scales, the oracle's gate |
    up and down weights of that rank in float32)."""
    experts, block = layout
    fmt = ModuleFormat(FP8_BLOCK, HF_FP8, block)
    gen = torch.Generator().manual_seed(seed)
    with acting_as(TPInfo(rank, tp)):
        layer = BlockFP8FusedExperts(experts.experts, experts.hidden, experts.intermediate,
                                     block)
        params, w13, w2 = experts_data(fmt, experts, rank, tp, gen)
        fill(layer, params)
    ref = tuple(torch.stack([w[e] for e in range(experts.experts)]).float() for w in (w13, w2))
    return layer, layer.block_scales(), ref


def _fp8_call(layout, tp, rank):
    """The arguments of `fused_moe` for a token through those experts, and the reference's
    weights under `ref`."""
    layer, (s13, s2), ref = _make_fp8(layout, tp, rank, seed=tp * 10 + rank)
    e = layout[0]
    x, weights, ids = _make_token(e.experts, e.top_k, e.hidden, torch.float32, seed=tp)
    return (x, weights, ids, layer.w13_weight, layer.w2_weight), \
        dict(w13_scales=s13, w2_scales=s2, ref=ref)


@pytest.fixture()
def launches(monkeypatch):
    recorder = LaunchRecorder(moe_rows._jit())
    monkeypatch.setattr(moe_rows, "_jit", lambda: recorder)
    return recorder.seen


@pytest.mark.parametrize("layout, tp, rank, modes",
                         [(PARTIAL, 1, 0, (2, 2)), (PARTIAL, 4, 3, (2, 2)),
                          (GROUPED, 2, 1, (1, 1))],
                         ids=["24x40-tp1", "24x40-tp4-rank3", "32x64-tp2-rank1"])
def test_block_fp8_matches_reference(launches, layout, tp, rank, modes):
    """Block-FP8 experts against the reference on the rank's exact weights: 24 x 40 blocks
    scale every element (at TP 4 rank 3 holds I = 32 from input 96, 16 into its column
    block); 32 x 64 blocks scale the partial sum of each step of 64 (gate/up: 3 steps, the
    last ragged) and 32 inputs (down: the rank is 32 inputs into its block, 3 steps)."""
    args, scales = _fp8_call(layout, tp, rank)
    _assert_experts(*args, f"fp8 {layout[1]} tp={tp} rank={rank}", **scales)
    taken = {name: (kw["SCALE"], kw["BLOCK_K"], kw["col_offset"]) for name, kw in launches}
    assert (taken["gate_up_rows_kernel"][0], taken["down_rows_kernel"][0]) == modes, taken
    if layout is GROUPED:
        assert taken["gate_up_rows_kernel"][1:] == (64, 0), taken
        assert taken["down_rows_kernel"][1:] == (32, 32), taken


def test_row_path_only_at_one_token(launches):
    """One token without tiles takes the two row launches (the slot sum folded into the
    second); several tokens, or one with grouped tiles, take the grouped kernels; row tiles
    at several tokens, routing weights that do not match the ids and FP8 weights without
    scales are refused by name."""
    w13, w2 = _make_experts(8, 48, 16, torch.float32, seed=0)
    x, weights, ids = _make_token(8, 2, 48, torch.float32, seed=1)
    fused_moe.fused_moe(x, weights, ids, w13, w2)
    assert [name for name, _ in launches] == ["gate_up_rows_kernel", "down_rows_kernel"]
    assert launches[1][1]["SUM_SLOTS"] is True, "the slot sum is not folded in"
    launches.clear()
    fused_moe.fused_moe(x, weights, ids, w13, w2, tiles=fused_moe.DECODE_TILES)
    three = torch.cat([x] * 3), torch.cat([weights] * 3), torch.cat([ids] * 3)
    fused_moe.fused_moe(*three, w13, w2)
    assert launches == [], [name for name, _ in launches]
    with pytest.raises(ValueError, match="row tiles serve one token, got 3"):
        fused_moe.fused_moe(*three, w13, w2, tiles=SMALL_TILES)
    with pytest.raises(ValueError, match=r"ids \(1, 2\) and weights \(1, 1\) differ"):
        fused_moe.fused_moe(x, weights[:, :1], ids, w13, w2)
    with pytest.raises(ValueError, match="w2 is float8_e4m3fn but has no block scales"):
        fused_moe.fused_moe(x, weights, ids, w13, w2.to(torch.float8_e4m3fn))


def test_default_tiles(monkeypatch):
    """On a GPU: 4 features per program and 1024-input steps at Qwen3.5-35B-A3B's TP 1
    (H 2048, I 512, top-8); fewer features per program where a launch would otherwise have
    under two programs per SM (I 64 at TP 8: 512 gate/up programs of one feature)."""
    monkeypatch.setattr(moe_rows, "interpreting", lambda: False)
    assert moe_rows.choose_tiles(2048, 512, 8) == RowMoeTiles(4, 4, 1024, 4)
    assert moe_rows.choose_tiles(2048, 64, 8) == RowMoeTiles(1, 4, 1024, 4)
    assert moe_rows.choose_tiles(512, 64, 8).down_n == 1


def _assert_caught(run, what):
    """`run` fails on the comparison (not on anything else)."""
    try:
        run()
    except AssertionError as err:
        assert "not close" in str(err), f"{what}: failed otherwise: {err}"
        return
    pytest.fail(f"{what}: the comparison passed")


def test_dropped_routing_weight_is_caught(monkeypatch):
    """A down launch that adds the slots unweighted (all routing weights 1) differs from the
    reference, summed and per slot."""
    original = moe_rows.down
    monkeypatch.setattr(moe_rows, "down", lambda h, weights, *a: original(
        h, torch.ones_like(weights), *a))
    w13, w2 = _make_experts(8, 64, 32, torch.float32, seed=5)
    x, weights, ids = _make_token(8, 4, 64, torch.float32, seed=6)
    _assert_caught(lambda: _assert_experts(x, weights, ids, w13, w2, "unweighted"),
                   "routing weight dropped")


def test_previous_slots_expert_is_caught(monkeypatch):
    """gate/up computing each slot with the previous slot's expert (the down projection
    with the slot's own) differs from the reference."""
    original = moe_rows.gate_up
    monkeypatch.setattr(moe_rows, "gate_up", lambda x, ids, *a: original(
        x, ids.roll(1, dims=1), *a))
    w13, w2 = _make_experts(8, 64, 32, torch.float32, seed=7)
    x, weights, ids = _make_token(8, 4, 64, torch.float32, seed=8)
    _assert_caught(lambda: _assert_experts(x, weights, ids, w13, w2, "rolled"),
                   "previous slot's expert")


def test_dropped_column_offset_is_caught(monkeypatch):
    """The down projection of a rank 32 inputs into its 64-wide column block, its steps'
    scale columns counted from the block's start (offset dropped), differs from the
    reference: its second step takes its first block's scale instead of the next one's."""
    original = moe_rows.down

    def no_offset(h, weights, ids, w2, tiles, block_k, scale_args, *rest):
        return original(h, weights, ids, w2, tiles, block_k, dict(scale_args, col_offset=0),
                        *rest)

    monkeypatch.setattr(moe_rows, "down", no_offset)
    args, scales = _fp8_call(GROUPED, 2, 1)
    assert scales["w2_scales"].col_offset == 32
    _assert_caught(lambda: _assert_experts(*args, "no offset", **scales), "offset dropped")


def _make_shared(hidden, shared_inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(2 * shared_inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(hidden, shared_inter, generator=gen) * shared_inter**-0.5
    gate = torch.randn(1, hidden, generator=gen) * hidden**-0.5
    return SharedExpertRows(w13.to(dtype), w2.to(dtype), gate.to(dtype))


def _assert_shared(shape, dtype, tiles=None, what=""):
    experts, top_k, hidden, inter, shared_inter = shape
    w13, w2 = _make_experts(experts, hidden, inter, dtype, seed=hidden + 1)
    shared = _make_shared(hidden, shared_inter, dtype, seed=shared_inter)
    x, weights, ids = _make_token(experts, top_k, hidden, dtype, seed=inter + 1)
    got = fused_moe.fused_moe(x, weights, ids, w13, w2, tiles=tiles, shared=shared)
    want = fused_moe.reference_moe_shared(x, weights, ids, w13, w2, shared)
    _assert_matches(got, want, f"{what} {dtype} {shape} {tiles}")
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, tiles", [((16, 8, 256, 128, 128), STEP_TILES),
                                          ((8, 2, 64, 32, 48), SMALL_TILES),
                                          ((8, 3, 100, 40, 24), SMALL_TILES)],
                         ids=["equal", "shared-wider", "shared-narrower-ragged"])
def test_shared_expert_in_rows_matches_reference(launches, dtype, shape, tiles):
    """The routed experts plus the gated shared expert, with the default tiles and smaller
    ones (several steps and feature blocks), in two launches whose grids carry top_k + 1
    slots; the shared intermediate size the routed one, larger (tiny-qwen3.5-moe's 48 over
    32) and smaller over ragged dims. A repeated launch gives the same bits."""
    first = _assert_shared(shape, dtype)
    _assert_shared(shape, dtype, tiles)
    assert [name for name, _ in launches] == ["gate_up_rows_kernel", "down_rows_kernel"] * 2
    assert all(kw["SHARED"] is True for _, kw in launches)
    assert torch.equal(first, _assert_shared(shape, dtype)), "repeat differs"


def test_shared_expert_refused_where_it_cannot_join():
    """The shared expert joins one token's summed 16-bit slots only; wrong shapes or dtypes
    are named."""
    w13, w2 = _make_experts(8, 48, 16, torch.float32, seed=0)
    shared = _make_shared(48, 16, torch.float32, seed=1)
    x, weights, ids = _make_token(8, 2, 48, torch.float32, seed=1)
    three = torch.cat([x] * 3), torch.cat([weights] * 3), torch.cat([ids] * 3)
    with pytest.raises(ValueError, match="shared expert joins one token's summed row"):
        fused_moe.fused_moe(*three, w13, w2, shared=shared)
    with pytest.raises(ValueError, match="shared expert joins one token's summed row"):
        fused_moe.fused_moe(x, weights, ids, w13, w2, sum_slots=False, shared=shared)
    wrong = SharedExpertRows(shared.w13, shared.w2, shared.gate.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"shared expert gate \(1, 48\) torch.bfloat16"):
        fused_moe.fused_moe(x, weights, ids, w13, w2, shared=wrong)
    wrong = SharedExpertRows(shared.w13[:16], shared.w2, shared.gate)
    with pytest.raises(ValueError, match=r"shared expert w13 \(16, 48\).*want \(32, 48\)"):
        fused_moe.fused_moe(x, weights, ids, w13, w2, shared=wrong)
    args, scales = _fp8_call(PARTIAL, 1, 0)
    scales.pop("ref")
    wide = _make_shared(PARTIAL[0].hidden, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="16-bit shared expert .* cannot join block-FP8"):
        fused_moe.fused_moe(*args, shared=wide, **scales)
    fp8 = _make_fp8_shared(PARTIAL[0].hidden, 32, (24, 40), 1, 0, seed=3)
    with pytest.raises(ValueError, match="block-FP8 shared expert .* cannot join 16-bit"):
        fused_moe.fused_moe(x, weights, ids, w13, w2,
                            shared=_make_fp8_shared(48, 32, (24, 40), 1, 0, seed=3))
    other = _make_fp8_shared(PARTIAL[0].hidden, 32, (24, 48), 1, 0, seed=3)
    with pytest.raises(ValueError, match=r"column block 48\) cannot join .*column block 40"):
        fused_moe.fused_moe(*args, shared=other, **scales)
    clipped = dataclasses.replace(fp8, w2_scale=fp8.w2_scale[:, :0])
    with pytest.raises(ValueError, match=r"w2's block scales .*scale torch.float32 \(5, 0\)"):
        fused_moe.fused_moe(*args, shared=clipped, **scales)


def _make_fp8_shared(hidden, full_inter, block, tp, rank, seed):
    """Rank `rank` of TP `tp`'s block-FP8 shared expert (random e4m3 codes and scales, the
    scale rows laid out as `BlockFP8Linear` lays out a [gate | up] column-parallel layer
    and a row-parallel down over `full_inter`) with a float32 gate."""
    gen = torch.Generator().manual_seed(seed)
    inter = full_inter // tp
    offset = rank * inter
    rows_in_block = (offset % block[0] + torch.arange(inter)) // block[0]
    gate_blocks = int(rows_in_block[-1]) + 1
    col_offset = offset % block[1]

    def codes(*shape):
        return torch.randn(*shape, generator=gen).clamp(-6, 6).to(torch.float8_e4m3fn)

    def scales(*shape):
        # Large enough that the shared slot weighs as much as the routed sum.
        return torch.rand(*shape, generator=gen) * 2 + 0.5

    return SharedExpertRows(
        codes(2 * inter, hidden), codes(hidden, inter),
        torch.randn(1, hidden, generator=gen) * hidden**-0.5,
        w13_scale=scales(2 * gate_blocks, -(-hidden // block[1])) * hidden**-0.5,
        w13_scale_row=torch.cat([rows_in_block, rows_in_block + gate_blocks]).int(),
        w2_scale=scales(-(-hidden // block[0]), -(-(col_offset + inter) // block[1])),
        w2_scale_row=(torch.arange(hidden) // block[0]).int(),
        block_cols=block[1], w2_col_offset=col_offset)


def _fp8_shared_call(layout, tp, rank, full_shared, tiles=None, shared=None):
    """(fused_moe of block-FP8 routed experts with a block-FP8 shared expert, the
    reference on the rank's exact weights)."""
    (x, weights, ids, w13, w2), scales = _fp8_call(layout, tp, rank)
    ref = scales.pop("ref")
    shared = shared or _make_fp8_shared(layout[0].hidden, full_shared, layout[1], tp, rank,
                                        seed=full_shared + rank)
    got = fused_moe.fused_moe(x, weights, ids, w13, w2, tiles=tiles, shared=shared, **scales)
    return got, fused_moe.reference_moe_shared(x, weights, ids, *ref, shared)


@pytest.mark.parametrize("layout, tp, rank, full_shared, modes",
                         [(GROUPED, 2, 1, 96, (1, 1, 1)), (PARTIAL, 4, 3, 64, (2, 2, 2)),
                          (GROUPED, 1, 0, 80, (1, 1, 1))],
                         ids=["32x64-tp2-rank1", "24x40-tp4-rank3", "32x64-tp1"])
def test_block_fp8_shared_expert_in_rows(launches, layout, tp, rank, full_shared, modes):
    """A block-FP8 shared expert as one more slot of block-FP8 routed experts' row
    kernels: its own scale rows in the gate/up launch, and in the down launch its own
    column offset and scale mode (TP 2 rank 1: 48 inputs from 48 into a 64-wide column
    block, a step of 16 where the routed down steps by 32; 24 x 40 blocks: every element
    scaled), against `reference_moe_shared` on the dequantized weights; small tiles as
    well; a repeat gives the same bits."""
    got, want = _fp8_shared_call(layout, tp, rank, full_shared)
    _assert_matches(got, want, f"fp8 shared {layout[1]} tp={tp} rank={rank}")
    taken = {name: kw for name, kw in launches}
    gate_up, down = taken["gate_up_rows_kernel"], taken["down_rows_kernel"]
    assert (gate_up["SCALE"], down["SCALE"], down["SHARED_SCALE"]) == modes, taken
    assert gate_up["SHARED"] and down["SHARED"]
    if layout is GROUPED and tp == 2:
        assert (down["shared_col_offset"], down["SHARED_BLOCK_K"]) == (48, 16), down
        assert (down["col_offset"], down["BLOCK_K"]) == (32, 32), down
    small, want_small = _fp8_shared_call(layout, tp, rank, full_shared, SMALL_TILES)
    _assert_matches(small, want_small, "small tiles")
    assert torch.equal(got, _fp8_shared_call(layout, tp, rank, full_shared)[0]), "repeat"


def test_fp8_shared_expert_offset_dropped_is_caught():
    """The shared down projection read from its block's start (the rank's column offset
    dropped) differs from the reference."""
    shared = _make_fp8_shared(GROUPED[0].hidden, 96, GROUPED[1], 2, 1, seed=97)
    got, _ = _fp8_shared_call(GROUPED, 2, 1, 96, shared=dataclasses.replace(
        shared, w2_col_offset=0))
    _, want = _fp8_shared_call(GROUPED, 2, 1, 96, shared=shared)
    _assert_caught(lambda: _assert_matches(got, want, "offset dropped"), "offset dropped")


def test_fp8_shared_expert_reading_routed_scales_is_caught(monkeypatch):
    """A gate/up launch whose shared slot reads the routed experts' scales (the shared
    scale pointers not passed) differs from the reference."""
    launcher = moe_rows._jit

    def routed_scales():
        real = launcher()

        class Swap:
            def __getattr__(self, name):
                kernel = getattr(real, name)
                if name != "gate_up_rows_kernel":
                    return kernel

                class Launch:
                    def __getitem__(self, grid):
                        def run(**kw):
                            kw.update(shared_scale_ptr=kw["scale_ptr"],
                                      shared_scale_row_ptr=kw["scale_row_ptr"],
                                      stride_shared_scale_row=kw["stride_scale_row"])
                            return kernel[grid](**kw)
                        return run
                return Launch()
        return Swap()

    monkeypatch.setattr(moe_rows, "_jit", routed_scales)
    _assert_caught(lambda: _assert_matches(*_fp8_shared_call(GROUPED, 2, 1, 96), "routed"),
                   "routed scales")


def test_ungated_shared_expert_is_caught(monkeypatch):
    """A down launch that adds the shared expert with a gate of one differs from the
    reference."""
    original = moe_rows.down

    def ungated(hidden_rows, *a):
        hidden_rows.gate = torch.ones_like(hidden_rows.gate)
        return original(hidden_rows, *a)

    monkeypatch.setattr(moe_rows, "down", ungated)
    _assert_caught(lambda: _assert_shared((8, 2, 64, 32, 48), torch.float32), "ungated")


def test_shared_expert_without_its_up_half_is_caught(monkeypatch):
    """The shared slot reading its gate rows for both halves (an up-row offset of zero)
    differs from the reference."""
    original = moe_rows.gate_up

    def gate_rows_only(x, ids, w13, tiles, block_k, scale_args, shared):
        half = shared.w13.shape[0] // 2
        clipped = SharedExpertRows(torch.cat([shared.w13[:half], shared.w13[:half]]),
                                   shared.w2, shared.gate)
        return original(x, ids, w13, tiles, block_k, scale_args, clipped)

    monkeypatch.setattr(moe_rows, "gate_up", gate_rows_only)
    _assert_caught(lambda: _assert_shared((8, 2, 64, 32, 48), torch.float32), "no up half")


def _residual_call(shape, dtype, shared_on, tiles=None):
    """(fused_moe with the residual, the reference: residual + the block's output, rounded
    as the decoder layer's separate add rounds it)."""
    experts, top_k, hidden, inter, shared_inter = shape
    w13, w2 = _make_experts(experts, hidden, inter, dtype, seed=hidden + 2)
    shared = _make_shared(hidden, shared_inter, dtype, seed=shared_inter + 3) if shared_on \
        else None
    x, weights, ids = _make_token(experts, top_k, hidden, dtype, seed=inter + 4)
    residual = (torch.randn(1, hidden, generator=torch.Generator().manual_seed(9)) * 4
                ).to(dtype)
    got = fused_moe.fused_moe(x, weights, ids, w13, w2, tiles=tiles, shared=shared,
                              residual=residual)
    block = (fused_moe.reference_moe_shared(x, weights, ids, w13, w2, shared) if shared_on
             else fused_moe.reference_moe(x, weights, ids, w13, w2))
    return got, residual + block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared_on", [True, False], ids=["shared", "routed-only"])
def test_residual_added_in_the_down_launch(launches, dtype, shared_on):
    """The decoder layer's residual added in the down launch (TP 1): residual + the routed
    sum (plus the gated shared expert), over ragged dims with several feature blocks; a
    repeated launch gives the same bits."""
    shape = (8, 3, 100, 40, 24)
    got, want = _residual_call(shape, dtype, shared_on, SMALL_TILES)
    _assert_matches(got, want, f"residual {dtype} shared={shared_on}")
    down = [kw for name, kw in launches if name == "down_rows_kernel"]
    assert down and all(kw["RESIDUAL"] is True for kw in down)
    assert torch.equal(got, _residual_call(shape, dtype, shared_on, SMALL_TILES)[0])


def test_residual_refused_where_it_cannot_join():
    """The residual joins one token's summed row kernels only, in the output's shape and
    dtype."""
    w13, w2 = _make_experts(8, 48, 16, torch.float32, seed=0)
    x, weights, ids = _make_token(8, 2, 48, torch.float32, seed=1)
    residual = torch.zeros(1, 48)
    with pytest.raises(ValueError, match="residual joins one token's summed row"):
        fused_moe.fused_moe(x, weights, ids, w13, w2, sum_slots=False, residual=residual)
    with pytest.raises(ValueError, match="residual joins one token's summed row"):
        fused_moe.fused_moe(torch.cat([x] * 2), torch.cat([weights] * 2),
                            torch.cat([ids] * 2), w13, w2, residual=residual)
    with pytest.raises(ValueError, match=r"residual \(1, 47\) torch.float32 does not fit"):
        fused_moe.fused_moe(x, weights, ids, w13, w2, residual=torch.zeros(1, 47))
    with pytest.raises(ValueError, match=r"residual \(1, 48\) torch.bfloat16 does not fit"):
        fused_moe.fused_moe(x, weights, ids, w13, w2, residual=residual.bfloat16())


def test_dropped_residual_is_caught(monkeypatch):
    """A down launch that leaves the residual out (the block's output alone) differs from
    the reference."""
    original = moe_rows.down
    signature = inspect.signature(original)

    def dropped(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        assert given.arguments.pop("residual") is not None
        return original(*given.args, **given.kwargs)

    monkeypatch.setattr(moe_rows, "down", dropped)
    _assert_caught(lambda: _assert_matches(*_residual_call((8, 2, 64, 32, 48), torch.float32,
                                                           True), "dropped"),
                   "residual dropped")
