"""NVFP4 Triton kernels in Triton's interpreter, float32 activations (the interpreter computes
bf16 arithmetic wrongly; bf16 is checked on GPU by bench/gpu_kernels_check.py): both MoE paths
and the dense linear agree with the torch reference, the expert alignment places every pair
exactly once, and the layers' triton backend matches their torch backend."""

from __future__ import annotations

import ptx_emulator
import pytest
import torch

from freetoken.formats.nvfp4.format import NVFP4FormatError
from freetoken.formats.nvfp4.quantizer import quantize
from freetoken.layers.quantization.nvfp4.reference import reference_moe
from freetoken_verify.checks.kernels.check import make_experts


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Kernels in this process run interpreted (sets TRITON_INTERPRET=1 for the process)."""
    from interpreted import require_interpreter

    require_interpreter()


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


def test_decode_tile_shapes_match_reference():
    """The decode path gives the reference's sum whatever its tiles: one 16-input group per
    step (5 steps over 80 inputs, and down walks 2 steps per slot across the slots' experts),
    one row per program (rows halved down to 1 for want of programs), and a last step cut by
    the row's end; the dense linear too."""
    from freetoken.kernels import nvfp4_launch, nvfp4_linear, nvfp4_moe
    from freetoken.layers.quantization.nvfp4.reference import reference_linear

    w = make_experts(4, 80, 32, 1, seed=5)      # 10 words per gate_up row, 4 per down row
    x, weights, ids = _make_routing(2, 4, 3, 80, seed=5)
    want = reference_moe(x, weights, ids, **w)
    q = quantize(torch.randn(24, 80, generator=torch.Generator().manual_seed(6)))
    lin = dict(packed=q.packed, block_scale=q.block_scale, global_scale=q.global_scale)
    for tiles in (nvfp4_launch.Tiles(decode_n=32, decode_words=1, decode_warps=1,
                                  decode_programs=1),
                  nvfp4_launch.Tiles(decode_n=16, decode_words=3, decode_warps=1,
                                  decode_programs=10**6)):
        _assert_close(nvfp4_moe.fused_moe(x, weights, ids, **w, path="decode", tiles=tiles),
                      want, f"decode {tiles}")
        _assert_close(nvfp4_linear.nvfp4_linear(x, **lin, path="decode", tiles=tiles),
                      reference_linear(x, **lin), f"linear {tiles}")


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


def test_ptx_word_decode_gives_every_e2m1_value_exactly():
    """The PTX of the GPU decode kernels, executed instruction by instruction on the CPU with
    the tables the kernels pass it, turns every nibble value at every position of a word into
    the float32 e2m1 value bit for bit (signs and zeros included)."""
    from freetoken.formats.nvfp4.format import E2M1_VALUES
    from freetoken.kernels import nvfp4_ptx

    program = nvfp4_ptx.word_asm()
    tables = {"$9": nvfp4_ptx.BF16_HIGH[0], "$10": nvfp4_ptx.BF16_HIGH[1],
              "$11": nvfp4_ptx.BF16_LOW[0], "$12": nvfp4_ptx.BF16_LOW[1],
              "$13": nvfp4_ptx.SIGN_TABLE}
    rng = torch.Generator().manual_seed(0)
    words = [sum(((v + 3 * j) % 16) << 4 * j for j in range(8)) for v in range(16)]
    words += torch.randint(0, 2**32, (64,), generator=rng, dtype=torch.int64).tolist()
    for word in words:
        out = ptx_emulator.run(program, [{**tables, "$8": word}])[0]
        for j in range(8):
            code = (word >> 4 * j) & 0xF
            want = float(E2M1_VALUES[code & 7]) * (-1.0 if code & 8 else 1.0)
            bits = torch.tensor([want], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
            assert out[f"${j}"] == bits, (f"word {word:#010x} nibble {j} (code {code}): PTX "
                                          f"gives {out[f'${j}']:#010x}, want {bits:#010x}")


def test_align_by_expert_places_every_pair_once():
    """Sorted rows hold each pair exactly once, every used block holds one expert's pairs
    only, padding rows hold the sentinel, unused blocks are -1."""
    from freetoken.kernels.moe_align import align_by_expert

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
    """NVFP4FusedExperts gives the same output on either backend."""
    from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts

    w = make_experts(4, 64, 32, 1, seed=3)
    layers = {b: NVFP4FusedExperts(4, 64, 32, backend=b) for b in ("torch", "triton")}
    for layer in layers.values():
        for name, src in (("w13_weight", "w13"), ("w13_weight_scale", "w13_scale"),
                          ("w13_weight_scale_2", "w13_global"), ("w2_weight", "w2"),
                          ("w2_weight_scale", "w2_scale"), ("w2_weight_scale_2", "w2_global")):
            getattr(layer, name).data.copy_(w[src])
    x, weights, ids = _make_routing(9, 4, 2, 64, seed=3)
    _assert_close(layers["triton"](x, weights, ids), layers["torch"](x, weights, ids), "moe")


def test_gate_up_mma_fits_the_register_cap_without_spilling():
    """`Tiles.mma_maxnreg` 88 (20 warps an SM where gate_up's own 97-99 registers give 16)
    compiles gate_up_mma for sm_90 without spills, plain and with the shared slot, and
    ptxas keeps to the cap."""
    from conftest import run_compiled

    for shape in (["--tp", "1,8", "--tokens", "1,16"], ["--tp", "1", "--tokens", "1",
                                                        "--shared"]):
        proc = run_compiled(["bench/nvfp4_sass.py", "--maxnreg", "88", *shape])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = [line.split() for line in proc.stdout.splitlines()
                if line[:1].isdigit() and line.split()[2] == "gate_up_mma"]
        assert rows, proc.stdout
        for row in rows:
            assert int(row[5]) <= 88 and row[6] == "0", row


def test_decode_kernels_compile_for_sm90_with_their_ptx():
    """`bench/nvfp4_sass.py` compiles the decode kernels' PTX path for sm_90 on this CPU
    machine (ptxas validates the inline PTX the interpreter never runs: the CUDA-core word
    decode and the tensor-core mma) and finds their inner loop: every row has registers, no
    spills and a plausible instruction count per weight, the tensor-core ones fewer than the
    CUDA-core ones."""
    from conftest import run_compiled

    proc = run_compiled(["bench/nvfp4_sass.py", "--tp", "1,8", "--tokens", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [r[2] for r in rows] == ["gate_up", "down", "gate_up_mma", "down_mma"] * 2, proc.stdout
    per_weight = {}
    for row in rows:
        regs, spill, per_weight[(row[0], row[2])] = int(row[5]), int(row[6]), float(row[8])
        assert 0 < regs <= 255 and spill == 0, row
        # the tensor-core kernels: no layout conversion through shared memory, no barrier in
        # the inner loop (the CUDA-core gate_up of float32 activations has one)
        assert row[9:11] == ["0", "0"] or not row[2].endswith("_mma"), \
            f"smem / bar in the loop: {row}"
        assert 2.0 < per_weight[(row[0], row[2])] < 40.0, row
    for tp in ("1", "8"):
        for kernel in ("gate_up", "down"):
            assert per_weight[(tp, kernel + "_mma")] < per_weight[(tp, kernel)], proc.stdout


_DENSE_SASS = """
import sys
sys.path.insert(0, "bench")
import nvfp4_sass
from freetoken.kernels import nvfp4_launch, nvfp4_mma_jit, nvfp4_mma_launch
tiles = nvfp4_launch.GPU_TILES
for name, fn, blocks, extra in (("dense_mma", nvfp4_mma_jit.dense_mma, 1, {"COLS": 16}),
                                ("dense_mma_8", nvfp4_mma_jit.dense_mma, 1, {"COLS": 8}),
                                ("down_mma", nvfp4_mma_jit.down_mma, 1, {"SCALED": 1})):
    v, split, chunks, row_tiles = nvfp4_mma_launch.mma_shape(blocks, 248320, 2048, 1, tiles,
                                                             tiles.mma_down_min_split)
    meta = dict(V=v, TILES=row_tiles, S=split, ASM=1, BF16=1, **extra,
                FULL=nvfp4_mma_launch.mma_full(248320, 2048, 1, v, split, row_tiles))
    if name == "down_mma":
        meta["CHUNKS"] = chunks
    sass, regs, spill = nvfp4_sass.compile_sass(fn, meta, split * row_tiles, 90)
    total, mix = nvfp4_sass.loop_mix(sass)
    weights = 3 * 2 * v * 8 * extra.get("COLS", 8) // 8   # per block of eight tokens
    print(name, regs, spill, total / weights, mix["LDS"] + mix["STS"], mix["BAR"])
"""


def test_dense_columns_kernel_compiles_lean_for_sm90():
    """The dense NVFP4 kernel with the tokens as the mma's columns (`dense_mma`, the LM head
    at 16 tokens: 16 columns, two mmas a step; and 8) compiles for sm_90 on its PTX path
    without spills, without shared memory or barriers in its loop, and with no more
    instructions per weight and block of eight tokens than the one-token decode
    (`down_mma`) it would replace there: decoding a weight once for eight or sixteen tokens
    must not cost more than decoding it for one."""
    from conftest import run_compiled

    proc = run_compiled(["-c", _DENSE_SASS])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r[0]: r[1:] for r in (line.split() for line in proc.stdout.splitlines())
            if r and r[0] in ("dense_mma", "dense_mma_8", "down_mma")}
    for name in ("dense_mma", "dense_mma_8"):
        regs, spill, per_weight, smem, bar = rows[name]
        assert 0 < int(regs) <= 128 and spill == "0" and smem == "0" and bar == "0", rows
        assert float(per_weight) <= float(rows["down_mma"][2]), rows


def test_mma_kernels_with_the_shared_slot_compile_for_sm90():
    """The tensor-core decode kernels with the shared expert's slot, the residual and globals
    that divide compile for sm_90 (ptxas on this CPU machine) without spills; down keeps
    its wide weight loads (the choice of expert per slot would cost their alignment without
    `ALIGNED`), so its instructions per weight stay near the plain kernel's."""
    from conftest import run_compiled

    proc = run_compiled(["bench/nvfp4_sass.py", "--tp", "8", "--tokens", "1", "--shared"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r[2]: r for r in (line.split() for line in proc.stdout.splitlines())
            if r[:1] == ["8"]}
    for kernel in ("gate_up_mma", "down_mma"):
        regs, spill, per_weight = int(rows[kernel][5]), int(rows[kernel][6]), \
            float(rows[kernel][8])
        assert 0 < regs <= 255 and spill == 0 and per_weight < 5.5, rows[kernel]
        assert rows[kernel][9:11] == ["0", "0"], f"smem / bar in the loop: {rows[kernel]}"


def test_decode_refuses_weights_whose_rows_are_not_whole_words():
    """The decode kernels read packed weights as int32 words: a w13 view whose rows do not
    start on 4-byte boundaries is refused with an error naming it, not read misaligned."""
    from freetoken.kernels import nvfp4_moe

    w = make_experts(4, 48, 32, 1, seed=9)
    x, weights, ids = _make_routing(2, 4, 2, 48, seed=9)
    padded = torch.zeros(*w["w13"].shape[:2], w["w13"].shape[2] + 1, dtype=torch.uint8)
    padded[..., :-1] = w["w13"]
    bad = {**w, "w13": padded[..., :-1]}        # rows 25 bytes apart
    with pytest.raises(NVFP4FormatError, match="w13"):
        nvfp4_moe.fused_moe(x, weights, ids, **bad, path="decode")
    want = reference_moe(x, weights, ids, **w)   # the same weights, contiguous: accepted
    _assert_close(nvfp4_moe.fused_moe(x, weights, ids, **{**bad, "w13": bad["w13"].contiguous()},
                                      path="decode"), want, "contiguous copy")
