"""The engine's per-token CUDA kernels (`freetoken.kernels.norm_rope`,
`freetoken.kernels.delta_rule`) in Triton's interpreter with float32 inputs, against the torch
layers the engine runs on CPU, at the TP-local shapes of TP 1, 2, 4 and 8: RMSNorm, rotary,
GatedDeltaNet's gated norm, SiLU-and-mul, and GatedDeltaNet's conv update and decode step."""

from __future__ import annotations

import pytest
import torch
from interpreted import TP_SIZES, interpreter  # noqa: F401  (module-wide fixture)
from interpreted import assert_close as _assert_close

from freetoken.layers.linear import local_kv_heads


def _module_weights(module, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_matches_module(tp, offset):
    """Decoder norms [tokens, hidden] and per-head q norms [tokens, 16 / tp, 32] of a
    strided view (q rows inside a fused projection) equal the torch RMSNorm's."""
    from freetoken.kernels.norm_rope import rms_norm
    from freetoken.layers.norm import RMSNorm

    norm = _module_weights(RMSNorm(32, 1e-6, offset=offset), tp)
    fused = torch.randn(7, (16 // tp + 2) * 32, generator=torch.Generator().manual_seed(tp))
    q = fused[:, : 16 // tp * 32].view(7, 16 // tp, 32)
    _assert_close(rms_norm(q, norm.weight, 1e-6, offset), norm(q), f"heads tp={tp}")
    x = torch.randn(5, 32)
    _assert_close(rms_norm(x, norm.weight, 1e-6, offset), norm(x), f"rows tp={tp}")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (64, 16)])
def test_rotary_matches_module(tp, head_dim, rotary_dim):
    """Full and partial rotary (a quarter of each head, as Qwen3.5) over 16 / tp q heads and
    the TP-local KV heads equal the torch RotaryEmbedding's, the rest of each head untouched."""
    from freetoken.kernels.norm_rope import rotary_
    from freetoken.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0)
    gen = torch.Generator().manual_seed(tp)
    q = torch.randn(6, 16 // tp, head_dim, generator=gen)
    k = torch.randn(6, local_kv_heads(2, tp), head_dim, generator=gen)
    positions = torch.tensor([0, 1, 5, 17, 300, 1999])
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = rotary_(q.clone(), k.clone(), positions, rope.inv_freq, rotary_dim)
    _assert_close(got_q, want_q, f"q tp={tp}")
    _assert_close(got_k, want_k, f"k tp={tp}")


@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (64, 16)])
def test_rotary_writes_the_cache_at_its_slots(head_dim, rotary_dim):
    """The rotary launch with the cache: q as without it, the rotated key (its unrotated
    tail included) and the value at their slots of the paged caches exactly as the rotary
    launch followed by the torch path's index assignment; every other slot untouched. A
    launch that left the key unrotated in the cache, or wrote the value to the key's cache,
    is caught."""
    from freetoken.kernels.norm_rope import rotary_
    from freetoken.layers.rotary import RotaryEmbedding

    def write_kv(k, v, k_cache, v_cache, slots):
        k_cache.view(-1, 2, head_dim)[slots] = k
        v_cache.view(-1, 2, head_dim)[slots] = v

    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0)
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(5, (4 + 2 * 2) * head_dim, generator=gen)   # [q | k | v] rows
    q = fused[:, : 4 * head_dim].view(5, 4, head_dim)
    k = fused[:, 4 * head_dim : 6 * head_dim].view(5, 2, head_dim)
    v = fused[:, 6 * head_dim :].view(5, 2, head_dim)
    positions = torch.tensor([0, 3, 9, 40, 1000])
    slots = torch.tensor([7, 0, 13, 2, 9])
    caches = [torch.randn(4, 4, 2, head_dim, generator=gen) for _ in range(2)]
    want = [c.clone() for c in caches]
    want_q, want_k = rotary_(q.clone(), k.clone(), positions, rope.inv_freq, rotary_dim)
    write_kv(want_k, v, want[0], want[1], slots)
    got_q, _ = rotary_(q.clone(), k.clone(), positions, rope.inv_freq, rotary_dim,
                       (v, caches[0], caches[1], slots))
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    unrotated = [c.clone() for c in want]
    write_kv(k, v, unrotated[0], unrotated[1], slots)
    assert not torch.equal(caches[0], unrotated[0])
    assert not torch.equal(caches[1], caches[0])
    with pytest.raises(ValueError, match="do not fit one cache write"):
        rotary_(q.clone(), k.clone(), positions, rope.inv_freq, rotary_dim,
                (v, caches[0], caches[1], slots[:3]))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gated_delta_decode_matches_recurrent_rule(tp):
    """One decode step over 16 / tp key heads and 32 / tp value heads (Qwen3.5's ratio)
    with dk != dv, gating and normalisation inside: the output and the state written back
    at each sequence's slot equal the torch path's (GatedDeltaNet's gating, l2norm and the
    recurrent rule); the slots not in the batch are untouched."""
    import torch.nn.functional as F

    from freetoken.kernels.delta_rule import gated_delta_decode
    from freetoken.layers.delta_rule import l2norm, recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(tp)
    batch, nk, nv, dk, dv = 3, 16 // tp, 32 // tp, 16, 8
    q, k = (torch.randn(batch, nk, dk, generator=gen) for _ in range(2))
    v = torch.randn(batch, nv, dv, generator=gen)
    a, b = (torch.randn(batch, nv, generator=gen) * 3 for _ in range(2))
    a_log, dt_bias = torch.randn(nv, generator=gen), torch.randn(nv, generator=gen)
    state = torch.randn(5, nv, dk, dv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    g = -a_log.exp() * F.softplus(a + dt_bias)
    rep = nv // nk
    q_n = (l2norm(q) * dk**-0.5).repeat_interleave(rep, 1)
    want_out, want_state = recurrent_gated_delta_rule(
        q_n[:, None], l2norm(k).repeat_interleave(rep, 1)[:, None], v[:, None], g[:, None],
        b.sigmoid()[:, None], state[slots])
    got_state = state.clone()
    got = gated_delta_decode(q, k, v, a, b, a_log, dt_bias, got_state, slots)
    _assert_close(got, want_out[:, 0], f"output tp={tp}")
    _assert_close(got_state[slots], want_state, f"state tp={tp}")
    assert torch.equal(got_state[[1, 3]], state[[1, 3]]), "a slot outside the batch changed"


@pytest.mark.parametrize("tp", TP_SIZES)
def test_conv_update_matches_causal_conv(tp):
    """One new input per sequence through the depthwise conv (kernel 4) over 96 / tp
    channels: silu(conv) and the shifted state at each slot equal CausalConv1d's; other
    slots untouched."""
    from freetoken.kernels.delta_rule import conv_update
    from freetoken.layers.causal_conv import CausalConv1d

    channels = 96 // tp
    conv = _module_weights(CausalConv1d(channels, 4), tp)
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(3, channels, generator=gen)
    state = torch.randn(5, channels, 3, generator=gen)
    slots = torch.tensor([4, 0, 2])
    want, want_state = conv(x[:, None], state[slots])
    got_state = state.clone()
    got = conv_update(x, conv.weight, got_state, slots)
    _assert_close(got, want[:, 0], f"output tp={tp}")
    assert torch.equal(got_state[slots], want_state), f"state tp={tp}"
    assert torch.equal(got_state[[1, 3]], state[[1, 3]]), "a slot outside the batch changed"


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gated_rms_norm_and_silu_and_mul_match_modules(tp):
    """GatedDeltaNet's output norm over 32 / tp value heads (the gate a strided view into a
    projection) and SiLU-and-mul of a [gate | up] view equal the torch paths."""
    from freetoken.kernels.norm_rope import gated_rms_norm, silu_and_mul
    from freetoken.layers.activation import silu_and_mul as torch_silu_and_mul
    from freetoken.layers.gated_norm import GatedRMSNorm

    heads, dim = 32 // tp, 8
    norm = _module_weights(GatedRMSNorm(dim, 1e-6), tp)
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(5, heads, dim, generator=gen)
    projection = torch.randn(5, heads * dim + 7, generator=gen)
    z = projection[:, 7:].view(5, heads, dim)
    _assert_close(gated_rms_norm(x, z, norm.weight, 1e-6), norm(x, z), f"gated norm tp={tp}")
    fused = torch.randn(4, 2 * 96 // tp + 3, generator=gen)[:, 3:]
    _assert_close(silu_and_mul(fused), torch_silu_and_mul(fused), f"silu_and_mul tp={tp}")


def _bench_module():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import decode_kernels

    return decode_kernels


def test_decode_attention_bench_case(monkeypatch):
    """`bench/decode_kernels.py --only attention` times a case whose launch agrees with the
    torch reference it reports against, at each of its arms (`paged_attention.DECODE`,
    here over three shuffled cache blocks a sequence), and so does the two-launch path it
    compares with; another copy's cache is told apart."""
    from freetoken.kernels import paged_attention as pa

    decode_kernels = _bench_module()
    gen = torch.Generator().manual_seed(0)
    caches, folded, unfolded, want = decode_kernels.attention_case(2, 40, gen, "cpu",
                                                                   torch.float32)
    _assert_close(unfolded(*caches[0]), want, "output (rotary launch, then attention)")
    for label, arm in decode_kernels._attention_arms():
        monkeypatch.setattr(pa, "DECODE", arm)
        _assert_close(folded(*caches[0]), want, f"output ({label})")
        other = folded(*caches[1])   # another copy's cache: the reference must tell them apart
        assert (other - want).abs().max() > 1e-3, label


def test_attention_launches_pipeline_their_loops():
    """Compiled for sm_90 on this CPU: the decode launch pipelines its loop (cp.async) and
    carries the split merge's counter (atomics); the launch before its options
    (`paged_attention.BEFORE`) and prefill keep Triton's default pipelining and no atomics.
    A decode at one stage has no cp.async, so the check can fail. The shipped decode lets
    the next kernel launch early (`launch_next`, once), `BEFORE`, prefill and a decode
    without `launch_next` do not, and none waits."""
    from conftest import run_compiled

    code = (
        "import dataclasses, sys; sys.path.insert(0, 'bench')\n"
        "import decode_kernels as dk\n"
        "from freetoken.kernels import paged_attention as pa\n"
        "for name, launch, decode in (('decode', pa.DECODE, True), ('before', pa.BEFORE, True),\n"
        "        ('one stage', dataclasses.replace(pa.DECODE, stages=1), True),\n"
        "        ('prefill', pa.DECODE, False),\n"
        "        ('no next', dataclasses.replace(pa.DECODE, launch_next=False), True)):\n"
        "    ptx = dk.attention_asm(launch, decode).asm['ptx']\n"
        "    print(name, ptx.count('cp.async.cg') + ptx.count('cp.async.ca'),\n"
        "          ptx.count('atom.'), ptx.count('griddepcontrol.launch_dependents'),\n"
        "          ptx.count('griddepcontrol.wait'), sep=':')\n")
    proc = run_compiled(["-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = {line.split(":")[0]: tuple(map(int, line.split(":")[1:]))
              for line in proc.stdout.splitlines()}
    assert counts["decode"][0] > 0 and counts["decode"][1] > 0, counts
    assert counts["before"][0] > 0 and counts["before"][1] == 0, counts
    assert counts["prefill"][0] > 0 and counts["prefill"][1] == 0, counts
    assert counts["one stage"][0] == 0, counts
    early = {name: c[2:] for name, c in counts.items()}
    assert early == {"decode": (1, 0), "one stage": (1, 0), "before": (0, 0),
                     "prefill": (0, 0), "no next": (0, 0)}, counts


def test_decode_kernels_bench_refuses_unknown_rows():
    """`bench/decode_kernels.py --only` names a row it does not know, before it needs a GPU."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "bench/decode_kernels.py"), "--only",
                           "route,atention"], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 2 and "unknown atention" in proc.stderr, proc.stderr


def _decode_batch():
    """Three decode sequences (contexts 5, 1 and 9) over shuffled cache blocks of 4 slots:
    (block tables, block size, the tables padded as a tensor, positions, cache slots of the
    new tokens, query starts, context lengths)."""
    contexts, block, tables = [5, 1, 9], 4, [[3, 0], [5], [1, 4, 2]]
    padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor([c - 1 for c in contexts])
    slots = torch.tensor([t[(c - 1) // block] * block + (c - 1) % block
                          for t, c in zip(tables, contexts)])
    return (tables, block, padded, positions, slots, torch.arange(4, dtype=torch.int32),
            torch.tensor(contexts, dtype=torch.int32))


@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (64, 16)])
def test_decode_attention_folds_rotary_and_cache_write(head_dim, rotary_dim):
    """Decode attention given unrotated q and this step's keys and values: the same output
    and caches as the rotary launch with the cache write followed by attention, q left as
    it was. Positions one off (a rotation by the wrong angle) are caught."""
    from freetoken.kernels.norm_rope import rotary_
    from freetoken.kernels.paged_attention import DecodeRope, paged_attention
    from freetoken.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0)
    gen = torch.Generator().manual_seed(5)
    _, block, padded, positions, slots, starts, lens = _decode_batch()
    rows = torch.randn(3, (4 + 2 * 2) * head_dim, generator=gen)
    q = rows[:, : 4 * head_dim].view(3, 4, head_dim)
    k = rows[:, 4 * head_dim : 6 * head_dim].view(3, 2, head_dim)
    v = rows[:, 6 * head_dim :].view(3, 2, head_dim)
    caches = [torch.randn(6, block, 2, head_dim, generator=gen) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    want_q, _ = rotary_(q.clone(), k.clone(), positions, rope.inv_freq, rotary_dim,
                        (v, *want_caches, slots))
    want = paged_attention(want_q, *want_caches, padded, starts, lens, head_dim**-0.5)
    q_before = q.clone()
    got_caches = [c.clone() for c in caches]
    got = paged_attention(q, *got_caches, padded, starts, lens, head_dim**-0.5, None,
                          DecodeRope(positions, rope.inv_freq, k, v, slots))
    _assert_close(got, want, "output")
    _assert_close(got_caches[0], want_caches[0], "k cache")
    assert torch.equal(got_caches[1], want_caches[1]) and torch.equal(q, q_before)
    off = [c.clone() for c in caches]
    wrong = paged_attention(q, *off, padded, starts, lens, head_dim**-0.5, None,
                            DecodeRope(positions + 1, rope.inv_freq, k, v, slots))
    assert (wrong - want).abs().max() > 1e-3
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(q, *off, padded, starts, lens, head_dim**-0.5, None,
                        DecodeRope(positions[:2], rope.inv_freq, k, v, slots))


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (64, 16)])
def test_decode_attention_folds_qk_norm_and_gate(offset, head_dim, rotary_dim):
    """Decode attention given unnormalised q and k (views into one projection row) with
    their per-head RMSNorms and the output gate folded in (`QKNorm`, `gate`): the same
    output and caches as the separate launches (q_norm and k_norm, the folded rotary, then
    `out * sigmoid(gate)`) and as the float32 reference. Injected bugs are caught: the q and
    k norm weights swapped, the offset flipped, a neighbouring token's gate."""
    from freetoken.kernels.norm_rope import rms_norm
    from freetoken.kernels.paged_attention import (
        DecodeRope,
        QKNorm,
        paged_attention,
        reference_decode_rope,
    )
    from freetoken.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0)
    gen = torch.Generator().manual_seed(7)
    heads = 4
    tables, block, padded, positions, slots, starts, lens = _decode_batch()
    rows = torch.randn(3, (2 * heads + 2 * 2) * head_dim, generator=gen) * 2
    q = rows[:, : heads * head_dim].view(3, heads, head_dim)
    gate = rows[:, heads * head_dim : 2 * heads * head_dim].view(3, heads, head_dim)
    k = rows[:, 2 * heads * head_dim : (2 * heads + 2) * head_dim].view(3, 2, head_dim)
    v = rows[:, (2 * heads + 2) * head_dim :].view(3, 2, head_dim)
    weights = [torch.randn(head_dim, generator=gen) * 0.3 + (0.0 if offset else 1.0)
               for _ in range(2)]
    norm = QKNorm(*weights, 1e-6, offset)
    caches = [torch.randn(6, block, 2, head_dim, generator=gen) for _ in range(2)]
    scale = head_dim**-0.5

    def run(fold: QKNorm, gate_rows: torch.Tensor):
        got_caches = [c.clone() for c in caches]
        out = paged_attention(q, *got_caches, padded, starts, lens, scale, None,
                              DecodeRope(positions, rope.inv_freq, k, v, slots, fold),
                              gate_rows)
        return out, got_caches

    want_caches = [c.clone() for c in caches]
    normed_k = rms_norm(k, weights[1], 1e-6, offset)
    separate = paged_attention(rms_norm(q, weights[0], 1e-6, offset), *want_caches, padded,
                               starts, lens, scale, None,
                               DecodeRope(positions, rope.inv_freq, normed_k, v, slots))
    separate = separate * torch.sigmoid(gate)
    reference, ref_k, _ = reference_decode_rope(rope, DecodeRope(positions, rope.inv_freq, k,
                                                                 v, slots, norm),
                                                q, *caches, tables, lens.tolist(), scale,
                                                gate)
    got, got_caches = run(norm, gate)
    _assert_close(got, separate, "output against the separate launches")
    _assert_close(got, reference, "output against the reference")
    _assert_close(got_caches[0], want_caches[0], "k cache")
    _assert_close(got_caches[0], ref_k, "k cache against the reference")
    assert torch.equal(got_caches[1], want_caches[1])
    for bug, fold, gate_rows in (
            ("q and k norm weights swapped", QKNorm(weights[1], weights[0], 1e-6, offset),
             gate),
            ("offset flipped", QKNorm(*weights, 1e-6, not offset), gate),
            ("a neighbouring token's gate", norm, gate.roll(1, 0))):
        wrong, _ = run(fold, gate_rows)
        assert (wrong - reference).abs().max() > 1e-3, bug
    with pytest.raises(ValueError, match="output gate"):
        paged_attention(q, *caches, padded, starts, lens, scale, None,
                        DecodeRope(positions, rope.inv_freq, k, v, slots, norm), gate[:, :2])
    with pytest.raises(ValueError, match="k_norm weight"):
        run(QKNorm(weights[0], weights[1][:-1], 1e-6, offset), gate)
