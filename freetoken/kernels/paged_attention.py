"""Launcher of the paged attention kernel (`attention_jit`): one launch per layer and step,
prefill (any number of sequences, causal with a cached offset) or decode (one query per
sequence), reading the block tables on the device. Decode needs no host data at all, so it
can be graphed. Checked against `reference_paged_attention`, the torch path the engine runs
on CPU (`freetoken.layers.attention.PagedAttention`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.kernels import jit_module, next_pow2
from freetoken.kernels.pdl import available as pdl_available


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("attention_jit")


@dataclass(frozen=True)
class DecodeLaunch:
    """How a decode launch runs (`DECODE`; `bench/decode_kernels.py --only attention` times
    the alternatives).

    `block_n`: cache positions per loop step, None for the prefill's (64, 32 for heads wider
    than 128). `seq_row`: sequence i's query is row i, not read from `query_starts`.
    `v_early`: each step's values are loaded beside its keys, not after the scores.
    `stages`: the loop's software-pipelining depth (1: none; None: Triton's default for the
    launch, as prefill takes). `num_warps`. `splits`: programs a (sequence, KV head) at
    most, each over the same whole number of `split_min`-position units (the last takes the
    rest; a context of at most `split_min` positions is one program, as with `splits` 1),
    merged by the last of them to finish, in split order; both powers of two. Launches
    that share a device share its split counters, so they run one after another, as the
    engine's do (one stream). `launch_next`: each program lets the stream's next kernel
    launch as it starts (programmatic dependent launch, sm_90+; the output projection's row
    kernel, launched with it under `gemv.ROW_PDL`, then loads its weights while attention
    runs). The defaults are the fastest measured (docs/performance.md); `BEFORE` is the
    launch before them."""

    seq_row: bool = True
    v_early: bool = True
    stages: int | None = 2
    num_warps: int = 8
    splits: int = 8
    split_min: int = 256
    block_n: int | None = None
    launch_next: bool = True

    def __post_init__(self):
        for name in ("splits", "split_min"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"paged_attention: DecodeLaunch.{name} is {value}, not a "
                                 f"power of two")


DECODE = DecodeLaunch()
BEFORE = DecodeLaunch(seq_row=False, v_early=False, stages=None, num_warps=4, splits=1,
                      launch_next=False)
"""The decode launch before `DecodeLaunch`'s options (one program a sequence and KV head,
Triton's default pipelining, 4 warps; the same SASS as then), for A/B runs."""


def block_n(head_dim: int, decode: bool, launch: DecodeLaunch | None = None) -> int:
    """BLOCK_N: cache positions per loop step (see `DecodeLaunch.block_n`; `launch`:
    `DECODE` when None)."""
    launch = launch or DECODE
    if decode and launch.block_n:
        return launch.block_n
    return 32 if head_dim > 128 else 64


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm of q and k before the rotary (Qwen3's and Qwen3.5's q_norm and
    k_norm): their weights [head_dim], the shared `eps`, and `offset` (the weight is
    `1 + w`, applied in float32), as `freetoken.layers.norm.RMSNorm`."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    offset: bool


@dataclass(frozen=True)
class DecodeRope:
    """A decode step's rotary and cache write, folded into its attention launch: the tokens'
    `positions` [T], the rotary's `inv_freq` [rotary_dim / 2] float32, this step's keys `k`
    (unrotated) and values `v` [T, kv_heads, d] (unit stride along d) and their cache slots
    `slot_mapping` [T]; `norm`: q and k normalised per head first (`QKNorm`), q and `k`
    given unnormalised."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    norm: QKNorm | None = None


def rows_per_program(num_heads: int, num_kv_heads: int, head_dim: int, decode: bool) -> int:
    """BLOCK_M: (query, head) rows per program; at least 16 for `tl.dot`, a whole GQA group
    for decode, and fewer for wide heads (the float32 accumulator lives in registers)."""
    group = num_heads // num_kv_heads
    if decode:
        return max(16, next_pow2(group))
    return max(16, next_pow2(group), 32 if head_dim > 128 else 64)


def prefill_work(query_lens: list[int], queries_per_program: int, device) -> torch.Tensor:
    """int32 [programs, 2]: (sequence, first query) of each prefill program (host data,
    known before the step)."""
    work = [(i, first) for i, qlen in enumerate(query_lens)
            for first in range(0, qlen, queries_per_program)]
    return torch.tensor(work, dtype=torch.int32, device=device).reshape(-1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_starts: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, work: torch.Tensor | None = None,
                    rope: DecodeRope | None = None, gate: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """q [T, heads, d]; k_cache, v_cache [blocks, block_size, kv_heads, d] with this step's
    keys already written; block_tables int32 [B, max_blocks]; query_starts int32 [B + 1]
    (sequence i's queries are q[query_starts[i]:query_starts[i + 1]]); context_lens int32
    [B]. `work` from `prefill_work`, or None for decode (one query per sequence, T = B).
    Returns [T, heads, d] in q's dtype. Decode with `rope`: q is unrotated and this step's
    keys are not in the cache yet; the launch rotates q and the keys and writes the keys and
    values first (q itself is left as it was), normalising both first with `rope.norm`.
    Decode with `gate` [T, heads, d] (unit stride along d): the rows come out times
    `sigmoid(gate)`. q needs a unit stride along d only (a view of a wider projection is
    read in place)."""
    tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    decode = work is None
    block_m = rows_per_program(num_heads, num_kv_heads, head_dim, decode)
    programs = block_tables.shape[0] if decode else work.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    splits = DECODE.splits if decode else 1
    _jit().paged_attention_kernel[(programs, num_kv_heads, splits)](
        **_rope_args(rope, q, k_flat, decode), **_gate_args(gate, q, decode),
        **_split_args(splits, programs * num_kv_heads, block_m, head_dim, q),
        q_ptr=q, k_cache_ptr=k_flat, v_cache_ptr=v_flat, out_ptr=out,
        block_tables_ptr=block_tables, query_starts_ptr=query_starts,
        context_lens_ptr=context_lens, work_ptr=block_tables if decode else work,
        scale=scale, block_size=block_size,
        stride_q_token=q.stride(0), stride_q_head=q.stride(1),
        stride_cache_slot=k_flat.stride(0), stride_cache_head=k_flat.stride(1),
        stride_out_token=out.stride(0), stride_out_head=out.stride(1),
        stride_table_seq=block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n(head_dim, decode), DECODE=decode,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **_decode_args(decode, pdl_ok=pdl_available(q)))
    return out


def _decode_args(decode: bool, launch: DecodeLaunch | None = None, pdl_ok: bool = True) -> dict:
    """The launch's `DecodeLaunch` arguments (`DECODE` when `launch` is None; none but 4
    warps for prefill); `pdl_ok`: the device has programmatic dependent launch
    (`launch_next`)."""
    if not decode:
        return dict(num_warps=4)
    launch = launch or DECODE
    return dict(SEQ_ROW=launch.seq_row, V_EARLY=launch.v_early, STAGES=launch.stages,
                SPLITS=launch.splits, SPLIT_MIN=launch.split_min, num_warps=launch.num_warps,
                PDL=int(launch.launch_next and pdl_ok))


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
"""Per device, every split counter buffer handed out, the largest last: int32 zeros that
each split launch leaves at zero. None is ever freed, since a captured graph keeps the
address it was given."""


def _split_args(splits: int, pairs: int, block_m: int, head_dim: int, q: torch.Tensor) -> dict:
    """The split decode's workspace (float32 partial rows, uninitialised) and its counters
    (one a (sequence, KV head) pair); placeholders for one split."""
    if splits == 1:
        return dict(partial_ptr=q, counter_ptr=q)
    kept = _COUNTERS.setdefault(q.device, [])
    if not kept or kept[-1].numel() < pairs:
        kept.append(torch.zeros(max(pairs, 2 * kept[-1].numel() if kept else 64),
                                dtype=torch.int32, device=q.device))
    width = max(16, next_pow2(head_dim)) + 2
    partial = torch.empty(pairs * splits * block_m * width, dtype=torch.float32,
                          device=q.device)
    return dict(partial_ptr=partial, counter_ptr=kept[-1])


def _rope_args(rope: DecodeRope | None, q: torch.Tensor, k_flat: torch.Tensor,
               decode: bool) -> dict:
    """The kernel's ROPE arguments (placeholders without `rope`); ValueError naming what
    does not fit."""
    if rope is None:
        return dict(positions_ptr=q, inv_freq_ptr=q, k_new_ptr=q, v_new_ptr=q,
                    slot_mapping_ptr=q, stride_k_new_token=0, stride_k_new_head=0,
                    stride_v_new_token=0, stride_v_new_head=0, q_norm_ptr=q, k_norm_ptr=q,
                    norm_eps=0.0)
    tokens = q.shape[0]
    if not decode:
        raise ValueError("paged_attention: the folded rotary is for decode steps only")
    if rope.k.shape != (tokens, *k_flat.shape[1:]) or rope.v.shape != rope.k.shape or \
            rope.k.stride(-1) != 1 or rope.v.stride(-1) != 1 or \
            tuple(rope.positions.shape) != (tokens,) or \
            tuple(rope.slot_mapping.shape) != (tokens,) or \
            rope.inv_freq.dtype != torch.float32 or \
            not 0 < 2 * rope.inv_freq.numel() <= q.shape[2]:
        raise ValueError(f"paged_attention: rotary of q {tuple(q.shape)} with keys "
                         f"{tuple(rope.k.shape)}, values {tuple(rope.v.shape)}, positions "
                         f"{tuple(rope.positions.shape)}, slots "
                         f"{tuple(rope.slot_mapping.shape)} and inv_freq "
                         f"{rope.inv_freq.dtype} {tuple(rope.inv_freq.shape)} does not fit "
                         f"a cache of {tuple(k_flat.shape[1:])} per slot")
    norm = rope.norm
    if norm is not None and (tuple(norm.q_weight.shape) != (q.shape[2],) or
                             norm.k_weight.shape != norm.q_weight.shape):
        raise ValueError(f"paged_attention: q_norm weight {tuple(norm.q_weight.shape)} and "
                         f"k_norm weight {tuple(norm.k_weight.shape)} do not fit heads of "
                         f"{q.shape[2]} channels")
    return dict(positions_ptr=rope.positions, inv_freq_ptr=rope.inv_freq, k_new_ptr=rope.k,
                v_new_ptr=rope.v, slot_mapping_ptr=rope.slot_mapping,
                stride_k_new_token=rope.k.stride(0), stride_k_new_head=rope.k.stride(1),
                stride_v_new_token=rope.v.stride(0), stride_v_new_head=rope.v.stride(1),
                ROPE=True, HALF=rope.inv_freq.numel(),
                q_norm_ptr=q if norm is None else norm.q_weight,
                k_norm_ptr=q if norm is None else norm.k_weight,
                norm_eps=0.0 if norm is None else norm.eps, QK_NORM=norm is not None,
                NORM_OFFSET=norm is not None and norm.offset)


def _gate_args(gate: torch.Tensor | None, q: torch.Tensor, decode: bool) -> dict:
    """The kernel's GATE arguments (a placeholder without `gate`); ValueError naming what
    does not fit."""
    if gate is None:
        return dict(gate_ptr=q, stride_gate_token=0, stride_gate_head=0)
    if not decode:
        raise ValueError("paged_attention: the folded output gate is for decode steps only")
    if gate.shape != q.shape or gate.stride(-1) != 1 or gate.dtype != q.dtype:
        raise ValueError(f"paged_attention: output gate {gate.dtype} {tuple(gate.shape)} "
                         f"(stride {gate.stride()}) does not fit q {q.dtype} "
                         f"{tuple(q.shape)}: the same shape and dtype, unit stride along "
                         f"head_dim")
    return dict(gate_ptr=gate, stride_gate_token=gate.stride(0),
                stride_gate_head=gate.stride(1), GATE=True)


def reference_paged_attention(q, k_cache, v_cache, block_tables: list[list[int]],
                              query_lens: list[int], context_lens: list[int], scale: float
                              ) -> torch.Tensor:
    """Per sequence: gather its context from the cache, expand the GQA groups and run
    causal SDPA with the cached offset (the engine's CPU path)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    k_flat, v_flat = k_cache.reshape(-1, num_kv_heads, head_dim), v_cache.reshape(
        -1, num_kv_heads, head_dim)
    out, start = torch.empty_like(q), 0
    for qlen, clen, blocks in zip(query_lens, context_lens, block_tables):
        pos = torch.arange(clen)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k = k_flat[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        v = v_flat[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.arange(clen - qlen, clen)[:, None] >= pos[None, :]
        part = F.scaled_dot_product_attention(q[start:start + qlen].transpose(0, 1), k, v,
                                              attn_mask=mask, scale=scale)
        out[start:start + qlen] = part.transpose(0, 1)
        start += qlen
    return out


def reference_decode_rope(rotary, rope: DecodeRope, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: list[list[int]],
                          context_lens: list[int], scale: float,
                          gate: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path of a decode launch given `rope` (`paged_attention(..., rope=rope,
    gate=gate)`): q and the step's keys normalised by `rope.norm` and rotated by `rotary`
    (a `RotaryEmbedding` on their device) in float32, the rotated keys and the values
    written at the step's slots of copies of the caches, then `reference_paged_attention`
    on the CPU in float32, times `sigmoid(gate)`. Returns (the output on the CPU, the k
    cache in float32 and the v cache in its dtype, on the caches' device); the inputs are
    left as they were."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    q, k = q.float().clone(), rope.k.float().clone()
    if rope.norm is not None:
        q, k = (_reference_rms_norm(x, w, rope.norm)
                for x, w in ((q, rope.norm.q_weight), (k, rope.norm.k_weight)))
    want_q, new_k = rotary(rope.positions, q, k)
    want_k = k_cache.float().clone()
    want_k.view(-1, num_kv_heads, head_dim)[rope.slot_mapping] = new_k
    want_v = v_cache.clone()
    want_v.view(-1, num_kv_heads, head_dim)[rope.slot_mapping] = rope.v
    out = reference_paged_attention(want_q.float().cpu(), want_k.cpu(), want_v.float().cpu(),
                                    block_tables, [1] * len(context_lens), list(context_lens),
                                    scale)
    if gate is not None:
        out = out * torch.sigmoid(gate.float().cpu())
    return out, want_k, want_v


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, norm: QKNorm) -> torch.Tensor:
    """float32 x normalised per head in float32 (`QKNorm`'s weight, `1 + w` with offset)."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return h * ((1.0 + weight.float()) if norm.offset else weight.float())
