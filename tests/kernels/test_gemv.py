"""The decode-step linear kernels (`freetoken.kernels.gemv`) in Triton's interpreter with
float32 inputs, against the torch steps they fuse (`reference_linear`,
`reference_moe_combine`), at TP-local shapes of TP 1, 2, 4 and 8 (scaled down): plain,
biased, norm-prologue (both RMSNorm forms), gated (SiLU-and-mul) and residual projections,
ragged sizes that exercise every mask, and the MoE block's combination."""

from __future__ import annotations

import json

import pytest
import torch
from interpreted import (
    TP_SIZES,
    LaunchRecorder,
    interpreter,  # noqa: F401  (module-wide fixture)
)
from interpreted import assert_close as _assert_close

from freetoken.kernels import gemv


def _make_linear(tokens, out_features, in_features, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    return x, weight, b


def _make_norm(in_features, offset, seed):
    gen = torch.Generator().manual_seed(seed + 100)
    return gemv.Norm(torch.randn(in_features, generator=gen) * 0.5, 1e-6, offset)


def _assert_linear(what, x, weight, bias=None, tiles=None, **fused):
    got = gemv.linear(x, weight, bias, tiles=tiles, **fused)
    want = gemv.reference_linear(x, weight, bias, **fused)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    _assert_close(got, want, what)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_plain_and_biased_projection(tp, tokens):
    """x W^T (+ b) for 512 / tp output features over 256 inputs (whole tiles) and for 100 /
    tp + 3 outputs over 200 inputs (a partial feature tile and a partial input step)."""
    for out_features, in_features in ((512 // tp, 256), (100 // tp + 3, 200)):
        for bias in (False, True):
            x, w, b = _make_linear(tokens, out_features, in_features, tp, bias)
            _assert_linear(f"tp={tp} T={tokens} {out_features}x{in_features} bias={bias}",
                           x, w, b)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("tokens", [1, 7])
def test_norm_prologue(offset, tokens):
    """RMSNorm fused before the projection equals RMSNorm then F.linear, for the plain
    (`w * round(x * s)`) and the offset (`x * s * (1 + w)`) forms, over inputs that are
    not a whole number of steps (the statistics must not count the padding)."""
    for in_features in (256, 200):
        x, w, _ = _make_linear(tokens, 48, in_features, in_features)
        x = x * 3.0 + 1.0
        _assert_linear(f"norm offset={offset} K={in_features}", x, w,
                       norm=_make_norm(in_features, offset, in_features))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gated_projection(tp):
    """A [gate | up] weight of 2 * 352 / tp rows (the medium MLP scaled down) gives
    silu(gate) * up, alone and behind a fused norm."""
    half = 352 // tp
    x, w, _ = _make_linear(3, 2 * half, 128, tp)
    _assert_linear(f"gated tp={tp}", x, w, gated=True)
    _assert_linear(f"gated+norm tp={tp}", x, w, gated=True, norm=_make_norm(128, True, tp))


@pytest.mark.parametrize("tokens", [1, 9])
def test_residual_epilogue(tokens):
    """An output projection with the residual add fused equals `residual + F.linear`."""
    x, w, b = _make_linear(tokens, 96, 160, tokens, bias=True)
    residual = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(7))
    _assert_linear(f"residual T={tokens}", x, w, b, residual=residual)


_ROW_TILES = [gemv.GemvTiles(block_n=1, block_k=64, split=1, rows=True),
              gemv.GemvTiles(block_n=4, block_k=128, split=1, rows=True),
              gemv.GemvTiles(block_n=8, block_k=64, split=2, rows=True)]
# tiles, tokens, out_features, in_features: a ragged input step, whole tiles, a ragged
# feature block with the inputs split in two
_ROW_CASES = [(_ROW_TILES[0], 2, 14, 200), (_ROW_TILES[1], 1, 64, 256),
              (_ROW_TILES[2], 3, 28, 200)]


@pytest.mark.parametrize("prefetch", [False, True, "all"],
                         ids=["in-step", "prefetch", "prefetch-all"])
@pytest.mark.parametrize("tiles, tokens, out_features, in_features", _ROW_CASES,
                         ids=[c[0].key() for c in _ROW_CASES])
def test_row_kernel(tiles, tokens, out_features, in_features, prefetch, monkeypatch):
    """The kernel without tensor cores (`rows` tiles) equals the torch steps for every
    fusion (bias, both norm forms, gated with norm and residual), over whole and ragged
    feature blocks and input steps, alone and split over the inputs (the second launch
    adding the parts), with the weights loaded in their step or a step ahead
    (`gemv.ROW_PREFETCH`, the normed calls; "all": every call, as a launch with programmatic
    dependent launch takes it, `gemv.prefetches`), the residual and norm weight loaded
    early (`gemv.ROW_EARLY`) where the weights are prefetched."""
    monkeypatch.setattr(gemv, "ROW_PREFETCH", bool(prefetch))
    monkeypatch.setattr(gemv, "ROW_EARLY", bool(prefetch))   # in-step: the loads in place
    if prefetch == "all":
        monkeypatch.setattr(gemv, "prefetches", lambda norm, pdl=False: True)
    x, w, b = _make_linear(tokens, out_features, in_features, out_features, bias=True)
    what = f"{tiles.key()} T={tokens} {out_features}x{in_features}"
    _assert_linear(f"{what} bias", x, w, b, tiles=tiles)
    _assert_linear(f"{what} norm", x * 3.0 + 1.0, w, tiles=tiles,
                   norm=_make_norm(in_features, False, out_features))
    residual = torch.randn(tokens, out_features // 2,
                           generator=torch.Generator().manual_seed(out_features))
    _assert_linear(f"{what} gated+norm+residual", x, w, tiles=tiles, gated=True,
                   norm=_make_norm(in_features, True, out_features), residual=residual)


def test_tile_entries_parse():
    """A tile table entry names the kernel (`r` for the row kernel) and its five numbers;
    `key` and `parse` are inverse, and a malformed entry is refused by name."""
    for tiles in _ROW_TILES + [gemv.GemvTiles(16, 256, 4, 4, 2)]:
        assert gemv.GemvTiles.parse(tiles.key()) == tiles, tiles.key()
    with pytest.raises(ValueError, match=r"'r4/x' is not"):
        gemv.GemvTiles.parse("r4/x")


def test_wrong_shapes_are_named():
    """A weight that takes another input width, a residual of the wrong shape or a gated
    weight of odd rows is refused with the shapes in the message."""
    x, w, _ = _make_linear(2, 32, 64, 0)
    with pytest.raises(ValueError, match=r"x has 48 input features, weight \(32, 64\)"):
        gemv.linear(x[:, :48], w)
    with pytest.raises(ValueError, match=r"residual \(2, 31\)"):
        gemv.linear(x, w, residual=torch.zeros(2, 31))
    with pytest.raises(ValueError, match=r"\(31, 64\) has an odd number of rows"):
        gemv.linear(x, w[:31], gated=True)


def test_fits_only_small_same_dtype_batches():
    """`fits` takes 1..MAX_TOKENS tokens of the weight's dtype, nothing else."""
    w = torch.zeros(8, 16)
    assert gemv.fits(torch.zeros(gemv.MAX_TOKENS, 16), w), "MAX_TOKENS tokens"
    assert not gemv.fits(torch.zeros(gemv.MAX_TOKENS + 1, 16), w), "one token too many"
    assert not gemv.fits(torch.zeros(0, 16), w), "no tokens"
    assert not gemv.fits(torch.zeros(2, 16, dtype=torch.float64), w.double()), "float64"
    assert not gemv.fits(torch.zeros(2, 16, dtype=torch.bfloat16), w), "dtype mismatch"


def _make_combine(tokens, top_k, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randn(tokens, top_k, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_weight = torch.randn(1, hidden, generator=gen) / hidden**0.5
    shared = torch.randn(tokens, hidden, generator=gen)
    return slots, x, gate_weight, shared


@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 8, 2048), (5, 2, 96), (16, 8, 1040)])
def test_moe_combine(tokens, top_k, hidden):
    """Routed slots summed, plus the shared expert scaled by its sigmoid gate, equal the
    MoE block's torch steps, for a hidden size of two blocks and one of a partial block."""
    parts = _make_combine(tokens, top_k, hidden, hidden)
    _assert_close(gemv.moe_combine(*parts), gemv.reference_moe_combine(*parts),
                  f"combine T={tokens} k={top_k} H={hidden}")


def test_moe_combine_adds_the_residual_after_rounding():
    """With the decoder layer's residual, the combine gives `residual + block output` as the
    torch steps give it (up to bf16 rounding), in float32 and bf16; a residual of another
    shape is refused, named."""
    slots, x, gate_weight, shared = _make_combine(3, 1, 96, 6)
    residual = torch.randn(3, 96, generator=torch.Generator().manual_seed(7)) * 50
    for dtype in (torch.float32, torch.bfloat16):
        parts = tuple(t.to(dtype) for t in (slots, x, gate_weight, shared))
        got = gemv.moe_combine(*parts, residual=residual.to(dtype))
        want = gemv.reference_moe_combine(*parts, residual=residual.to(dtype))
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0.5)
        without = gemv.moe_combine(*parts)
        assert (got.float() - without.float()).abs().max() > 10, "residual ignored"
    with pytest.raises(ValueError, match=r"residual \(3, 95\) does not fit x \(3, 96\)"):
        gemv.moe_combine(slots, x, gate_weight, shared, residual=residual[:, :95])


def test_moe_combine_takes_one_rounded_slot():
    """Experts that sum their own slots (NVFP4) give one slot in x's dtype: combined as the
    MoE block's torch steps combine it (in bf16, to its roundings); other slot dtypes and
    counts are refused, naming them."""
    slots, x, gate_weight, shared = (t.bfloat16() for t in _make_combine(3, 1, 96, 5))
    got = gemv.moe_combine(slots, x, gate_weight, shared)
    want = gemv.reference_moe_combine(slots, x, gate_weight, shared)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2)
    assert (got.float() - (slots[:, 0] + shared).float()).abs().max() > 1e-1, "gate ignored"
    with pytest.raises(ValueError, match=r"slots \(3, 2, 96\) torch.bfloat16"):
        gemv.moe_combine(torch.cat([slots, slots], 1), x, gate_weight, shared)
    with pytest.raises(ValueError, match="one slot in x's dtype"):
        gemv.moe_combine(slots.half(), x, gate_weight, shared)


def test_moe_combine_uses_every_slot_and_the_gate():
    """Dropping the last slot or the gate changes the result: the check above would see a
    kernel that sums top_k - 1 slots or leaves the shared expert ungated."""
    slots, x, gate_weight, shared = _make_combine(2, 4, 64, 3)
    got = gemv.moe_combine(slots, x, gate_weight, shared)
    fewer = gemv.reference_moe_combine(slots[:, :3], x, gate_weight, shared)
    ungated = slots.sum(dim=1) + shared
    assert (got - fewer).abs().max() > 1e-2, "the last slot made no difference"
    assert (got - ungated).abs().max() > 1e-2, "the gate made no difference"


@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_inputs_match_unsplit(split):
    """Inputs split over programs (partial sums added by the second launch) give the same
    projection, norm prologue, gated pairing, bias and residual as one program per block:
    splits that divide the steps evenly, unevenly (3 parts of 5 steps) and that leave the
    last part short (200 inputs in steps of 64)."""
    for in_features in (320, 200):
        tiles = gemv.GemvTiles(block_n=16, block_k=64, split=split)
        x, w, b = _make_linear(4, 2 * 40, in_features, split, bias=True)
        residual = torch.randn(4, 40, generator=torch.Generator().manual_seed(split))
        norm = _make_norm(in_features, False, split)
        what = f"split={split} K={in_features}"
        for fused in (dict(), dict(norm=norm, gated=True), dict(residual=residual)):
            weight = w if fused.get("gated") else w[:40]
            bias = b if fused.get("gated") else b[:40]
            got = gemv.linear(x, weight, bias, tiles=tiles, **fused)
            _assert_close(got, gemv.reference_linear(x, weight, bias, **fused),
                          f"{what} {sorted(fused)}")


def test_default_tiles_split_a_few_rows_over_many_inputs():
    """Without a measured entry, a router-sized weight (256 x 2048) is split 8 ways and a
    wide projection (12352 rows) is not split: enough programs either way."""
    with pytest.MonkeyPatch.context() as patch:   # the compiled choice, not the interpreter's
        patch.setattr(gemv, "interpreting", lambda: False)
        assert gemv.choose_tiles(256, 2048, torch.bfloat16).split == 8, "router"
        assert gemv.choose_tiles(12352, 2048, torch.bfloat16).split == 1, "wide projection"
    assert gemv.choose_tiles(256, 2048, torch.bfloat16) == gemv.GemvTiles(64, 256), \
        "interpreted: wide blocks, no split"


def test_table_entries_choose_tiles_or_the_gemm(monkeypatch, tmp_path):
    """A measured entry sets the tiles of its shape, fusion and token bucket; "gemm" and a
    missing entry send a 16-bit call to the unfused path (None), float32 takes the
    default tiles; a malformed table file is named."""
    x, w, _ = _make_linear(3, 64, 128, 0)
    table = {gemv.table_key(64, 128, 3, False, False, True): "gemm",
             gemv.table_key(64, 128, 3, False, False, False): "32/128/8/3/2"}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("FREETOKEN_GEMV_TABLE", str(path))
    gemv._table.cache_clear()
    try:
        assert gemv.tiles_for(x.bfloat16(), w.bfloat16()) == gemv.GemvTiles(32, 128, 8, 3, 2)
        assert gemv.tiles_for(x.bfloat16(), w.bfloat16(), residual=torch.zeros(3, 64)) is None
        assert gemv.tiles_for(x[:1].bfloat16(), w.bfloat16()) is None, \
            "the one-token bucket has no entry: unfused"
        assert gemv.tiles_for(x, w) == gemv.choose_tiles(64, 128, torch.float32), "float32"
        path.write_text("{not json")
        gemv._table.cache_clear()
        with pytest.raises(ValueError, match="FREETOKEN_GEMV_TABLE=.*tiles.json"):
            gemv.tiles_for(x.bfloat16(), w.bfloat16())
    finally:
        gemv._table.cache_clear()


_NORMED_TILES = [None, gemv.GemvTiles(block_n=16, block_k=64, split=3),
                 *(tiles for tiles, *_ in _ROW_CASES)]


@pytest.mark.parametrize("tiles", _NORMED_TILES,
                         ids=["default", "dot-split3", *(c[0].key() for c in _ROW_CASES)])
@pytest.mark.parametrize("offset", [False, True])
def test_normed_input_stored(tiles, offset):
    """With `normed`, the launch also stores the normalised x its dot read, for the MoE
    block's experts after its router: every element of it (the buffer starts as NaN) equals
    `reference_norm`, from the dot tiles and the row kernel, one program per input range
    or the inputs split over programs (each part storing its own range), over several
    feature blocks and a ragged last step; the projection is unchanged."""
    for tokens in (1, 3):
        x, w, _ = _make_linear(tokens, 40, 200, tokens)
        x = x * 3.0 + 1.0
        norm = _make_norm(200, offset, tokens)
        normed = torch.full_like(x, float("nan"))
        got = gemv.linear(x, w, tiles=tiles, norm=norm, normed=normed)
        what = f"normed T={tokens} offset={offset} {tiles}"
        _assert_close(got, gemv.reference_linear(x, w, norm=norm), f"{what} output")
        _assert_close(normed, gemv.reference_norm(x, norm), f"{what} normalised x")


def test_normed_input_refused_without_a_norm_or_in_another_shape():
    x, w, _ = _make_linear(2, 16, 64, 0)
    norm = _make_norm(64, True, 0)
    with pytest.raises(ValueError, match=r"normed \(2, 64\).*norm given: False"):
        gemv.linear(x, w, normed=torch.empty_like(x))
    with pytest.raises(ValueError, match=r"normed \(1, 64\) torch.float32 takes the "
                                         r"normalised x \(2, 64\)"):
        gemv.linear(x, w, norm=norm, normed=torch.empty(1, 64))
    with pytest.raises(ValueError, match=r"normed \(2, 64\) torch.bfloat16"):
        gemv.linear(x, w, norm=norm, normed=torch.empty(2, 64, dtype=torch.bfloat16))


def test_normed_store_of_the_raw_input_is_caught(monkeypatch):
    """A launch storing x as it was loaded, not normalised (the store placed before the
    prologue's scaling), differs from `reference_norm`: the comparison catches it."""
    original = gemv.linear

    def raw(x, weight, bias=None, *, normed=None, **kwargs):
        out = original(x, weight, bias, normed=normed, **kwargs)
        normed.copy_(x)
        return out

    monkeypatch.setattr(gemv, "linear", raw)
    x, w, _ = _make_linear(1, 40, 200, 0)
    norm = _make_norm(200, True, 0)
    normed = torch.empty_like(x)
    gemv.linear(x * 3.0 + 1.0, w, norm=norm, normed=normed)
    with pytest.raises(AssertionError, match="not close"):
        _assert_close(normed, gemv.reference_norm(x * 3.0 + 1.0, norm), "raw store")


def test_every_launch_names_only_its_kernels_parameters(monkeypatch):
    """Each launch of `linear` (dot tiles, the row kernel, split over the inputs with the
    reduction launch, the norm with its stored input, gated with the residual) passes only
    arguments its kernel takes: the interpreter ignores an unknown one, the compiled launch
    refuses it."""
    recorders = {name: LaunchRecorder(getattr(gemv, name)()) for name in ("_jit", "_rows_jit")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(gemv, name, lambda recorder=recorder: recorder)
    x, w, b = _make_linear(2, 2 * 24, 200, 0, bias=True)
    norm = _make_norm(200, True, 0)
    residual = torch.randn(2, 24)
    for rows in (False, True):
        for split in (1, 2):
            tiles = gemv.GemvTiles(block_n=8 if rows else 16, block_k=64, split=split,
                                   rows=rows)
            gemv.linear(x, w, tiles=tiles, norm=norm, normed=torch.empty_like(x))
            gemv.linear(x, w, b, tiles=tiles, gated=True, residual=residual)
    seen = {name for recorder in recorders.values() for name, _ in recorder.seen}
    assert seen == {"gemv_kernel", "gemv_rows_kernel", "gemv_reduce_kernel"}, seen


_ROW_PTX = """
import json, sys
from bench import nvfp4_sass
from freetoken.kernels import gemv, jit_module
fn = jit_module("gemv_rows_jit").gemv_rows_kernel
pointers = {p: "*bf16" for p in ("x_ptr", "weight_ptr", "bias_ptr", "norm_weight_ptr",
                                 "residual_ptr", "out_ptr", "normed_ptr")}
pointers.update(partial_ptr="*fp32", eps="fp32")
# the sizes and strides Triton marks divisible by 16 at the medium Llama's shapes
DIVISIBLE = {"out_features", "in_features", "split_features", "stride_x_token",
             "stride_weight_row", "stride_residual_token", "stride_out_token",
             "stride_normed_token"}
out = {}
for name, entry, norm, gated, residual in json.loads(sys.argv[1]):
    tiles = gemv.GemvTiles.parse(entry)
    meta = dict(NORM=int(norm), STORE_NORMED=False, GATED=gated, HAS_BIAS=False,
                HAS_RESIDUAL=residual, SPLIT=False, EVEN_K=True, BLOCK_N=tiles.block_n,
                BLOCK_K=tiles.block_k, NORM_BLOCK=1024,
                PREFETCH=gemv.prefetches(norm, bool(int(sys.argv[2]))), PDL=int(sys.argv[2]),
                EARLY=int(sys.argv[3]))
    kernel = nvfp4_sass.compile_kernel(fn, meta, tiles.num_warps, 90,
                                       {"num_stages": tiles.num_stages}, pointers=pointers,
                                       divisible=set(pointers) - {"eps"} | DIVISIBLE)
    out[name] = kernel.asm["ptx"]
print(json.dumps(out))
"""
# The medium Llama's one-token layer at its shipped tiles: qkv + norm, o + residual,
# gate_up + norm, down + residual.
_MEDIUM_ROWS = [("qkv", "r2/1024/4/1/1", True, False, False),
                ("o", "r2/1024/4/2/1", False, False, True),
                ("gate_up", "r2/1024/4/1/1", True, True, False),
                ("down", "r1/2048/4/2/1", False, False, True)]
_ROW_EARLY = {"weight_ptr", "bias_ptr", "norm_weight_ptr", "tokens", "out_features",
              "in_features", "split_features", "eps", "stride_x_token", "stride_weight_row",
              "stride_residual_token", "stride_partial_split", "stride_out_token",
              "stride_normed_token"}


def _row_ptx(pdl: bool, early: bool = True) -> dict[str, str]:
    from conftest import run_compiled

    proc = run_compiled(["-c", _ROW_PTX, json.dumps(_MEDIUM_ROWS), str(int(pdl)),
                         str(int(early))])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_row_kernel_with_pdl_reads_x_only_after_the_wait():
    """The row kernel launched with programmatic dependent launch (`gemv.ROW_PDL`), compiled
    for sm_90 at the medium Llama's one-token tiles: it lets the next kernel launch, loads
    only weights before `griddepcontrol.wait` (at least one tile) and reads x, the
    residual, and writes, only after it (traced from the PTX's parameters,
    `ptx_order.early_read_problems`). The check fails on the wait moved to the end (x read
    early), on the early launch dropped, and on the kernel launched without PDL."""
    from ptx_order import early_read_problems, param_names, wait_moved_to_end

    from freetoken.kernels import jit_module

    names = param_names(jit_module("gemv_rows_jit").gemv_rows_kernel)
    assert names[:2] == ["x_ptr", "weight_ptr"] and names[-1] == "stride_normed_token", names
    ptx = _row_ptx(True)
    assert sorted(ptx) == sorted(name for name, *_ in _MEDIUM_ROWS)
    for name, text in ptx.items():
        assert early_read_problems(text, names, _ROW_EARLY) == [], name
        problems = early_read_problems(wait_moved_to_end(text), names, _ROW_EARLY)
        assert any("load of x_ptr" in p for p in problems), (name, problems)
        dropped = text.replace("griddepcontrol.launch_dependents", "// dropped")
        assert early_read_problems(dropped, names, _ROW_EARLY), name
    for name, text in _row_ptx(False).items():
        assert "griddepcontrol" not in text, name
        assert early_read_problems(text, names, _ROW_EARLY), name


def _loads_before_a_barrier(ptx: str, names: list[str], wanted: set[str]) -> set[str]:
    """Which of the `wanted` parameters some load reads before the kernel's first
    `bar.sync`."""
    from ptx_order import traced_params

    early = set()
    for kind, _, params in traced_params(ptx):
        if kind == "barrier":
            break
        if kind == "load":
            early |= {names[i] for i in params if i < len(names)} & wanted
    return early


def test_row_kernel_loads_the_residual_and_norm_weight_before_its_reductions():
    """With `gemv.ROW_EARLY` (compiled for sm_90 at the medium Llama's one-token tiles) the
    row kernel issues its residual and its first norm-weight loads before the first
    cross-warp reduction's barrier, which a load cannot pass; without it (the check
    failing) they wait behind it. The launcher prefetches the normed calls here
    (`gemv.prefetches`)."""
    from ptx_order import param_names

    from freetoken.kernels import jit_module

    names = param_names(jit_module("gemv_rows_jit").gemv_rows_kernel)
    wanted = {"residual_ptr", "norm_weight_ptr"}
    want = {"qkv": {"norm_weight_ptr"}, "o": {"residual_ptr"}, "gate_up": {"norm_weight_ptr"},
            "down": {"residual_ptr"}}
    for early, expect in ((True, want), (False, dict.fromkeys(want, set()))):
        ptx = _row_ptx(False, early)
        assert all("bar.sync" in text for text in ptx.values())
        got = {name: _loads_before_a_barrier(text, names, wanted) for name, text in ptx.items()}
        assert got == expect, (early, got)
