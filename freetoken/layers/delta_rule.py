"""The gated delta rule, GatedDeltaNet's linear attention, in plain torch (CPU and GPU).

Per head, with state S [dk, dv], decay g_t <= 0 (log space) and rate beta_t:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

`recurrent_gated_delta_rule` runs that token by token (decode); `chunk_gated_delta_rule`
computes the same in chunks (prefill): inside a chunk the sequential updates are condensed by
a triangular solve (the UT transform), and only the state is carried from chunk to chunk.
Both follow HF transformers' torch fallbacks for Qwen3.5 in operation order, so they agree
with HF to fp32 rounding. Everything runs in fp32; callers cast the output. `exp` is the
exponential both use (the tp_invariant mode passes one whose result per element does not
depend on how many heads are in the launch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (the FLA / HF formula, eps inside)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    """[B, T, H, ...] -> fp32 [B, H, T, ...], contiguous."""
    return [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
            for x in xs]


def _initial(state: torch.Tensor | None, shape, device) -> torch.Tensor:
    if state is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return state.to(torch.float32)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, exp=torch.exp):
    """One token at a time.

    q, k: [B, T, H, dk] (already normalised and scaled); v: [B, T, H, dv]; g, beta: [B, T, H];
    initial_state: [B, H, dk, dv] or None (zeros). Returns (out [B, T, H, dv] fp32,
    final_state [B, H, dk, dv] fp32)."""
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    state = _initial(initial_state, (batch, heads, dk, dv), v.device)
    out = torch.empty_like(v)
    for t in range(length):
        state = state * exp(g[:, :, t])[..., None, None]
        k_t = k[:, :, t].unsqueeze(-1)
        predicted = (state * k_t).sum(dim=-2)
        delta = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2), state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size=CHUNK_SIZE,
                           exp=torch.exp):
    """The same result as `recurrent_gated_delta_rule`, `chunk_size` tokens at a time.

    Same shapes and return value. The sequence is zero-padded to a whole number of chunks:
    padded steps have g = 0 and beta = 0 and zero keys, so they leave the state unchanged."""
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)

    # Log decay from the chunk start to each position; decay[i, j] = exp(gc_i - gc_j) for
    # j <= i is what a write at j has faded to when read at i (0 above the diagonal).
    gc = g.cumsum(dim=-1)
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(future, float("-inf"))
    decay = exp(decay)

    # (I + strictly-lower(beta K K^T * decay)) turns the chunk's sequential delta updates into
    # one solve; unitriangular=True ignores the stored diagonal.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(system, k_beta * exp(gc).unsqueeze(-1),
                                                upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * exp(gc).unsqueeze(-1)
    k_decayed = k * exp(gc[..., -1:] - gc).unsqueeze(-1)
    chunk_decay = exp(gc[..., -1])[..., None, None]

    state = _initial(initial_state, (batch, heads, dk, dv), v.device)
    out = torch.empty_like(new_values)
    for i in range(chunks):
        # Only the part of each new value that the carried state does not already predict
        # is written (the delta rule).
        v_new = new_values[:, :, i] - state_reads[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2), state
