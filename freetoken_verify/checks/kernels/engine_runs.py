"""One engine-kernel case run: inputs built as the engine builds them (views into fused
projections, shuffled cache blocks, a state pool larger than the batch), the launcher of
`freetoken.kernels` called through its module (so an injected fault sees the call), and the
torch path the engine runs on CPU as the reference.

Inputs are drawn in float32 and rounded to the run's dtype; references run in float32 on the
same rounded values, on the run's device (attention's on the CPU: it builds its indices and
masks there). Every runner returns `Output`s: a kernel result beside its reference, `exact` for
copies, integer results and untouched state, which must be equal bit for bit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.formats.fp8 import block as fp8_block
from freetoken.kernels import delta_rule, norm_rope
from freetoken.kernels import fused_moe as moe
from freetoken.kernels import paged_attention as attention
from freetoken.kernels.moe_align import align_by_expert, align_small
from freetoken.kernels.moe_rows import SharedExpertRows, dequantize_rows
from freetoken.layers.activation import silu_and_mul as torch_silu_and_mul
from freetoken.layers.causal_conv import CausalConv1d
from freetoken.layers.delta_rule import l2norm, recurrent_gated_delta_rule
from freetoken.layers.gated_norm import GatedRMSNorm
from freetoken.layers.moe import route as torch_route
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken_verify.checks.kernels.engine_cases import EngineCase
from freetoken_verify.checks.kernels.quant_cases import REAL_BLOCK


@dataclass
class Output:
    """A kernel result `got` beside its reference `want`; `what` names it in a failing row."""

    what: str
    got: torch.Tensor
    want: torch.Tensor
    exact: bool = False


class _Inputs:
    """Random tensors on `device` from one seeded generator, drawn in float32 and rounded to
    the run's dtype (`_ref` gives the reference the same values in float32)."""

    def __init__(self, device, dtype: torch.dtype, seed: int):
        self.device, self.dtype = torch.device(device), dtype
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def draw(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(shape, generator=self.gen, device=self.device) * scale
        return x.to(self.dtype)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen, device=self.device)


def _ref(x: torch.Tensor, device=None) -> torch.Tensor:
    return x.to(device or x.device, torch.float32)


def _int32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _paged_cache(inp: _Inputs, contexts, block: int, kv: int, dim: int):
    """Random k and v caches [blocks, block, kv, dim] with a few blocks to spare, each
    context's blocks drawn from a shuffled pool: (k_cache, v_cache, block tables as lists,
    the same as int32 [B, max blocks] zero-padded)."""
    need = [-(-c // block) for c in contexts]
    num_blocks = sum(need) + 4
    k_cache, v_cache = inp.draw(num_blocks, block, kv, dim), inp.draw(num_blocks, block, kv, dim)
    pool = inp.perm(num_blocks).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in need]
    padded = torch.tensor([t + [0] * (max(need) - len(t)) for t in tables], dtype=torch.int32,
                          device=inp.device)
    return k_cache, v_cache, tables, padded


def paged_attention(case: EngineCase, inp: _Inputs) -> list[Output]:
    heads, kv, dim, block = case["heads"], case["kv heads"], case["head_dim"], case["block"]
    contexts = case["contexts"]
    decode = case["mode"] == "decode"
    queries = (1,) * len(contexts) if decode else case["queries"]
    k_cache, v_cache, tables, padded = _paged_cache(inp, contexts, block, kv, dim)
    q = inp.draw(sum(queries), heads, dim)
    starts = _int32([0, *queries], inp.device).cumsum(0).to(torch.int32)
    work = None
    if not decode:
        rows = attention.rows_per_program(heads, kv, dim, decode=False)
        work = attention.prefill_work(list(queries), rows // (heads // kv), inp.device)
    got = attention.paged_attention(q, k_cache, v_cache, padded, starts,
                                    _int32(contexts, inp.device), dim**-0.5, work)
    want = attention.reference_paged_attention(
        _ref(q, "cpu"), _ref(k_cache, "cpu"), _ref(v_cache, "cpu"), tables, list(queries),
        list(contexts), dim**-0.5)
    return [Output("output", got, want)]


def decode_rope(case: EngineCase, inp: _Inputs) -> list[Output]:
    """Decode attention given unrotated q and this step's keys and values (views into a
    fused projection row, Qwen3.5's output gate among them): the launch normalises q and k
    per head (`qk_norm` "w" or "1 + w"), rotates them, writes the cache, attends and
    multiplies the rows by `sigmoid(gate)` (`gate`). Reference: the norms, the rotary
    module, the cache write, the attention and the gate of the torch path."""
    heads, kv, dim, block = case["heads"], case["kv heads"], case["head_dim"], case["block"]
    contexts = case["contexts"]
    rope = RotaryEmbedding(dim, case["rotary_dim"], case["theta"],
                           dict(case["scaling"]) or None).to(inp.device)
    k_cache, v_cache, tables, padded = _paged_cache(inp, contexts, block, kv, dim)
    gates = heads if case["gate"] else 0
    rows = inp.draw(len(contexts), (heads + gates + 2 * kv) * dim)
    q = rows[:, : heads * dim].view(-1, heads, dim)
    gate = rows[:, heads * dim : (heads + gates) * dim].view(-1, heads, dim) if gates else None
    k = rows[:, (heads + gates) * dim : (heads + gates + kv) * dim].view(-1, kv, dim)
    v = rows[:, (heads + gates + kv) * dim :].view(-1, kv, dim)
    norm = None
    if case["qk_norm"] != "none":
        offset = case["qk_norm"] == "1 + w"
        weights = [inp.draw(dim, scale=0.3) + (0.0 if offset else 1.0) for _ in range(2)]
        norm = attention.QKNorm(*weights, 1e-6, offset)
    positions = torch.tensor([c - 1 for c in contexts], device=inp.device)
    slots = torch.tensor([t[(c - 1) // block] * block + (c - 1) % block
                          for t, c in zip(tables, contexts)], device=inp.device)
    starts = torch.arange(len(contexts) + 1, dtype=torch.int32, device=inp.device)
    q_before = q.clone()
    got_k, got_v = k_cache.clone(), v_cache.clone()
    fold = attention.DecodeRope(positions, rope.inv_freq, k, v, slots, norm)
    got = attention.paged_attention(q, got_k, got_v, padded, starts,
                                    _int32(contexts, inp.device), dim**-0.5, None, fold, gate)
    want, want_k, want_v = attention.reference_decode_rope(rope, fold, q, k_cache, v_cache,
                                                           tables, contexts, dim**-0.5, gate)
    return [Output("output", got, want), Output("k cache", got_k, want_k),
            Output("v cache", got_v, want_v, exact=True),
            Output("q (left unrotated)", q, q_before, exact=True)]


def rotary(case: EngineCase, inp: _Inputs) -> list[Output]:
    dim, rotary_dim = case["head_dim"], case["rotary_dim"]
    scaling = dict(case["scaling"]) or None
    rope = RotaryEmbedding(dim, rotary_dim, case["theta"], scaling).to(inp.device)
    q, k = inp.draw(6, case["heads"], dim), inp.draw(6, case["kv heads"], dim)
    positions = torch.tensor([0, 1, 5, 17, 300, 1999], device=inp.device)
    want_q, want_k = rope(positions, _ref(q), _ref(k))
    got_q, got_k = norm_rope.rotary_(q.clone(), k.clone(), positions, rope.inv_freq,
                                     rotary_dim)
    # The same launch storing the rotated key and the value at their cache slots (the
    # engine's attention layers on the CUDA paths); the cache's other slots stay as they were.
    v = inp.draw(6, case["kv heads"], dim)
    caches = [inp.draw(3, 4, case["kv heads"], dim) for _ in range(2)]
    slots = inp.perm(12)[:6]
    want_caches = [_ref(c) for c in caches]
    want_caches[0].view(-1, case["kv heads"], dim)[slots] = want_k
    want_caches[1].view(-1, case["kv heads"], dim)[slots] = _ref(v)
    fused_q, _ = norm_rope.rotary_(q.clone(), k.clone(), positions, rope.inv_freq, rotary_dim,
                                   (v, caches[0], caches[1], slots))
    return [Output("q", got_q, want_q), Output("k", got_k, want_k),
            Output("q (cache write)", fused_q, want_q),
            Output("k cache (cache write)", caches[0], want_caches[0]),
            Output("v cache (cache write)", caches[1], want_caches[1])]


def rms_norm(case: EngineCase, inp: _Inputs) -> list[Output]:
    offset = case["offset"]
    if "heads" in dict(case.dims):
        heads, dim = case["heads"], case["head_dim"]
        # Per-head q norm of a view into the fused projection row.
        x = inp.draw(7, (heads + 2) * dim)[:, :heads * dim].view(7, heads, dim)
    else:
        dim = case["rows"]
        x = inp.draw(5, dim)
    weight = inp.draw(dim, scale=0.5)
    norm = RMSNorm(dim, 1e-6, offset=offset).to(inp.device)
    norm.weight.data = _ref(weight)
    return [Output("output", norm_rope.rms_norm(x, weight, 1e-6, offset), norm(_ref(x)))]


def gated_rms_norm(case: EngineCase, inp: _Inputs) -> list[Output]:
    heads, dim = case["heads"], case["dv"]
    x = inp.draw(5, heads, dim)
    z = inp.draw(5, heads * dim + 7)[:, 7:].view(5, heads, dim)
    weight = inp.draw(dim, scale=0.5)
    norm = GatedRMSNorm(dim, 1e-6).to(inp.device)
    norm.weight.data = _ref(weight)
    got = norm_rope.gated_rms_norm(x, z, weight, 1e-6)
    return [Output("output", got, norm(_ref(x), _ref(z)))]


def silu_and_mul(case: EngineCase, inp: _Inputs) -> list[Output]:
    x = inp.draw(4, 2 * case["intermediate"] + 3)[:, 3:]
    return [Output("output", norm_rope.silu_and_mul(x), torch_silu_and_mul(_ref(x)))]


def _router_logits(inp: _Inputs, tokens: int, experts: int) -> torch.Tensor:
    """Distinct logits per token (multiples of 8 / experts within +-4, exact in bf16), so no
    top-k tie can order experts differently in the kernel and the reference."""
    rows = [inp.perm(experts) for _ in range(tokens)]
    return ((torch.stack(rows) - experts // 2) * (8.0 / experts)).to(inp.dtype)


def fused_moe(case: EngineCase, inp: _Inputs) -> list[Output]:
    experts, hidden, inter = case["experts"], case["hidden"], case["intermediate"]
    w13 = inp.draw(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = inp.draw(experts, hidden, inter, scale=inter**-0.5)
    x = inp.draw(case["tokens"], hidden)
    weights, ids = torch_route(_ref(_router_logits(inp, case["tokens"], experts)), case["top_k"],
                         True, torch.float32)
    got = moe.fused_moe(x, weights.to(inp.dtype), ids, w13, w2)
    want = moe.reference_moe(_ref(x), _ref(weights.to(inp.dtype)), ids, _ref(w13), _ref(w2))
    return [Output("output", got, want)]


def fused_moe_shared(case: EngineCase, inp: _Inputs) -> list[Output]:
    experts, hidden, inter = case["experts"], case["hidden"], case["intermediate"]
    shared_inter = case["shared intermediate"]
    w13 = inp.draw(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = inp.draw(experts, hidden, inter, scale=inter**-0.5)
    shared = SharedExpertRows(inp.draw(2 * shared_inter, hidden, scale=hidden**-0.5),
                              inp.draw(hidden, shared_inter, scale=shared_inter**-0.5),
                              inp.draw(1, hidden, scale=hidden**-0.5))
    x = inp.draw(1, hidden)
    weights, ids = torch_route(_ref(_router_logits(inp, 1, experts)), case["top_k"], True,
                               torch.float32)
    residual = inp.draw(1, hidden, scale=4.0)
    got = moe.fused_moe(x, weights.to(inp.dtype), ids, w13, w2, shared=shared)
    want = moe.reference_moe_shared(
        _ref(x), _ref(weights.to(inp.dtype)), ids, _ref(w13), _ref(w2),
        SharedExpertRows(*(_ref(t) for t in (shared.w13, shared.w2, shared.gate))))
    # At TP 1 the decoder layer's residual add joins the down launch.
    got_residual = moe.fused_moe(x, weights.to(inp.dtype), ids, w13, w2, shared=shared,
                                 residual=residual)
    return [Output("output", got, want),
            Output("output + residual", got_residual, _ref(residual) + want),
            _fused_moe_shared_fp8(case, inp, x, weights.to(inp.dtype), ids)]


def _fp8_shard(w: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 block scales) of `w` [N, K] as the rank that starts `offset`
    inputs into its first column block holds them."""
    padded = torch.cat([w.new_zeros(w.shape[0], offset), w], dim=1)
    codes, scale = fp8_block.quantize(padded, REAL_BLOCK)
    return codes[:, offset:].contiguous(), scale


def _fp8_gate_up(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, each row's scale row) of a [gate | up] weight [2I, H] whose halves
    keep scale rows of their own (`BlockFP8Linear`'s segments)."""
    inter = w13.shape[0] // 2
    (gate, gate_s), (up, up_s) = (_fp8_shard(half, 0) for half in w13.split(inter))
    rows = torch.arange(inter, device=w13.device) // REAL_BLOCK[0]
    return (torch.cat([gate, up]), torch.cat([gate_s, up_s]),
            torch.cat([rows, rows + gate_s.shape[0]]).to(torch.int32))


def _fp8_shared_operands(w13, w2, offset):
    codes13, scale13, rows13 = _fp8_gate_up(w13)
    codes2, scale2 = _fp8_shard(w2, offset)
    rows2 = (torch.arange(w2.shape[0], device=w2.device) // REAL_BLOCK[0]).to(torch.int32)
    return (codes13, scale13, rows13), (codes2, scale2, rows2)


def _fused_moe_shared_fp8(case: EngineCase, inp: _Inputs, x, weights, ids) -> Output:
    """Block-FP8 routed experts with a block-FP8 shared expert in the same row launches
    (Qwen's FP8 releases at batch 1), the residual added; each down projection as the last
    rank holds it (its offset inside a 128-wide column block), against the torch steps on
    the dequantized weights."""
    experts, hidden, inter = case["experts"], case["hidden"], case["intermediate"]
    shared_inter = case["shared intermediate"]
    tp = case.tp or 1
    offsets = [(tp - 1) * n % REAL_BLOCK[1] for n in (inter, shared_inter)]
    routed = [_fp8_shared_operands(inp.draw(2 * inter, hidden, scale=hidden**-0.5).float(),
                                   inp.draw(hidden, inter, scale=inter**-0.5).float(),
                                   offsets[0]) for _ in range(experts)]
    (s13, s13_scale, s13_rows), (s2, s2_scale, s2_rows) = _fp8_shared_operands(
        inp.draw(2 * shared_inter, hidden, scale=hidden**-0.5).float(),
        inp.draw(hidden, shared_inter, scale=shared_inter**-0.5).float(), offsets[1])
    gate = inp.draw(1, hidden, scale=hidden**-0.5)
    residual = inp.draw(1, hidden, scale=4.0)
    stacked = [torch.stack([r[part][i] for r in routed]) for part in (0, 1) for i in (0, 1)]
    w13_rows, w2_rows = routed[0][0][2], routed[0][1][2]
    shared = SharedExpertRows(s13, s2, gate, w13_scale=s13_scale, w13_scale_row=s13_rows,
                              w2_scale=s2_scale, w2_scale_row=s2_rows,
                              block_cols=REAL_BLOCK[1], w2_col_offset=offsets[1])
    got = moe.fused_moe(x, weights, ids, stacked[0], stacked[2],
                        w13_scales=moe.ExpertBlockScales(stacked[1], w13_rows, REAL_BLOCK[1]),
                        w2_scales=moe.ExpertBlockScales(stacked[3], w2_rows, REAL_BLOCK[1],
                                                        offsets[0]),
                        shared=shared, residual=residual)
    want = moe.reference_moe_shared(
        _ref(x), _ref(weights), ids,
        dequantize_rows(stacked[0], stacked[1], w13_rows, REAL_BLOCK[1]),
        dequantize_rows(stacked[2], stacked[3], w2_rows, REAL_BLOCK[1], offsets[0]),
        dataclasses.replace(shared, gate=_ref(gate)))
    return Output("block FP8 output + residual", got, _ref(residual) + want)


def route(case: EngineCase, inp: _Inputs) -> list[Output]:
    logits = _router_logits(inp, case["tokens"], case["experts"])
    want_w, want_ids = torch_route(_ref(logits), case["top_k"], True, torch.float32)
    got_w, got_ids = moe.route(logits, case["top_k"], True, torch.float32)
    return [Output("expert ids", got_ids, want_ids, exact=True),
            Output("weights", got_w, want_w)]


def align(case: EngineCase, inp: _Inputs) -> list[Output]:
    experts = case["experts"]
    ids = torch.randint(0, experts, (case["pairs"],), generator=inp.gen, device=inp.device)
    got, want = align_small(ids, experts, case["block"]), align_by_expert(
        ids, experts, case["block"])
    return [Output("rows", got[0], want[0], exact=True),
            Output("block experts", got[1], want[1], exact=True)]


def gated_delta_decode(case: EngineCase, inp: _Inputs) -> list[Output]:
    batch, nk, nv, dk, dv = (case[k] for k in ("batch", "key heads", "value heads", "dk", "dv"))
    # q, k and v are views into the conv output row, b and a into the projection row.
    mixed = inp.draw(batch, 2 * nk * dk + nv * dv)
    q, k = (mixed[:, i * nk * dk:(i + 1) * nk * dk].view(batch, nk, dk) for i in range(2))
    v = mixed[:, 2 * nk * dk:].view(batch, nv, dv)
    proj = inp.draw(batch, 2 * nv + 5, scale=3.0)
    b, a = proj[:, 5:5 + nv], proj[:, 5 + nv:]
    a_log, dt_bias = inp.draw(nv), inp.draw(nv)
    state = inp.draw(case["slots"], nv, dk, dv).float()
    slots, others = _slots(case["slots"], batch, inp.device)
    g = -_ref(a_log).exp() * F.softplus(_ref(a) + _ref(dt_bias))
    rep = nv // nk
    q_n = (l2norm(_ref(q)) * dk**-0.5).repeat_interleave(rep, 1)
    k_n = l2norm(_ref(k)).repeat_interleave(rep, 1)
    want, want_state = recurrent_gated_delta_rule(
        q_n[:, None], k_n[:, None], _ref(v)[:, None], g[:, None], _ref(b).sigmoid()[:, None],
        state[slots])
    got_state = state.clone()
    got = delta_rule.gated_delta_decode(q, k, v, a, b, a_log, dt_bias, got_state, slots,
                                        out_dtype=inp.dtype)
    return [Output("output", got, want[:, 0]), Output("state", got_state[slots], want_state),
            Output("state of slots outside the batch", got_state[others], state[others],
                   exact=True)]


def _slots(num_slots: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's state slots, out of order and not the first ones, and the others."""
    order = list(range(num_slots - 1, -1, -2))[:batch]
    order += [s for s in range(num_slots) if s not in order][:batch - len(order)]
    others = [s for s in range(num_slots) if s not in order]
    return (torch.tensor(order, dtype=torch.long, device=device),
            torch.tensor(others, dtype=torch.long, device=device))


def conv_update(case: EngineCase, inp: _Inputs) -> list[Output]:
    channels, kernel, batch = case["channels"], case["kernel"], case["batch"]
    conv = CausalConv1d(channels, kernel).to(inp.device)
    weight = inp.draw(*conv.weight.shape, scale=0.5)
    conv.weight.data = _ref(weight)
    x = inp.draw(batch, channels + 9)[:, :channels]
    state = inp.draw(5, channels, kernel - 1)
    slots, others = _slots(5, batch, inp.device)
    want, want_state = conv(_ref(x)[:, None], _ref(state[slots]))
    got_state = state.clone()
    got = delta_rule.conv_update(x, weight, got_state, slots)
    return [Output("output", got, want[:, 0]), Output("state", got_state[slots], want_state),
            Output("state of slots outside the batch", got_state[others], state[others],
                   exact=True)]


RUNNERS = {"paged_attention": paged_attention, "decode_rope": decode_rope,
           "rotary": rotary,
           "rms_norm": rms_norm, "gated_rms_norm": gated_rms_norm,
           "silu_and_mul": silu_and_mul, "fused_moe": fused_moe,
           "fused_moe_shared": fused_moe_shared, "route": route,
           "align": align, "gated_delta_decode": gated_delta_decode,
           "conv_update": conv_update}


def run_case(case: EngineCase, device, dtype: torch.dtype, seed: int) -> list[Output]:
    """The case's kernel launch and reference, on inputs drawn from `seed`."""
    return RUNNERS[case.kernel](case, _Inputs(device, dtype, seed))
