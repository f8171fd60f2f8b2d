"""bisect on the batched generation golden runs: every prompt's greedy continuation decoding
together, every module of every engine step recorded (`capture.capture_batched`), so a bug
that needs several sequences in one step (a block table laid out for the wrong row) is named
by the step and the first module where it starts: `first divergence: batched step 1 (decode
of prompts 0, 1, 2)/model.layers.0.self_attn.o_proj (...)`.

Each step is compared with (a) the same step at TP=1 (when the bisect check ran there, and as
long as every sequence in the step consumed the same tokens as at TP=1), bit for bit when the
run is bitwise, and (b) HF run on each prompt followed by the engine's own greedy tokens (the
activations a correct model computes on the context the engine decoded), its rows gathered as
the step laid out its sequences and positions."""

from __future__ import annotations

import torch

from freetoken.engine.core import resolve_dtype
from freetoken_verify.activations.hf import NameMap, hf_activations
from freetoken_verify.checks.base import CheckContext, compared_engine_args
from freetoken_verify.checks.bisect.capture import BatchedCapture, StepLayout, capture_batched
from freetoken_verify.checks.bisect.rows import build_rows, references
from freetoken_verify.checks.bisect.table import Bisection
from freetoken_verify.reference.sources import hf_model, prompts_for


def localise(ctx: CheckContext) -> Bisection:
    """The batched generation's first divergence at this TP size (captured once per model
    and TP size, `Baselines.batched_bisection`; at TP=1 kept for later sizes as
    `Baselines.tp1_batched`)."""
    return ctx.baselines.batched_bisection(ctx.tp, lambda: _localise(ctx))


def _localise(ctx: CheckContext) -> Bisection:
    prompts, num_greedy = prompts_for(ctx.case, ctx.options)
    tp1 = ctx.baselines.tp1_batched if ctx.tp > 1 else None
    hf_runs = ctx.case.model_config.quantization is None
    if ctx.tp > 1 and tp1 is None and not hf_runs:
        return Bisection()
    run = capture_batched(ctx.runner, compared_engine_args(ctx), prompts, num_greedy)
    if ctx.tp == 1:
        ctx.baselines.tp1_batched = run
    tp1_full = None
    if tp1 is not None:
        same = comparable_steps(run, tp1, prompts)
        tp1_full = {k: v for k, v in tp1.full.items() if k.partition("/")[0] in same}
    hf_for = _hf_lookup(ctx, run, prompts) if hf_runs else (lambda key, tensor: (None, None))
    return Bisection(build_rows(run.full, tp1_full, hf_for, ctx),
                     references(ctx, tp1 is not None, hf_runs))


def comparable_steps(run: BatchedCapture, tp1: BatchedCapture,
                     prompts: list[list[int]]) -> set[str]:
    """Names of the steps laid out as at TP=1 whose sequences all consumed the same ids as at
    TP=1 so far (after the first token that differs, the inputs differ too)."""
    same = set()
    for index, (mine, theirs) in enumerate(zip(run.steps, tp1.steps)):
        if mine != theirs:
            break
        if all(_ids(run, prompts, s)[: start + qlen] == _ids(tp1, prompts, s)[: start + qlen]
               for s, start, qlen in mine.sequences):
            same.add(mine.name(index))
    return same


def _ids(run: BatchedCapture, prompts: list[list[int]], seq: int) -> list[int]:
    return list(prompts[seq]) + list(run.tokens[seq])


def _hf_lookup(ctx: CheckContext, run: BatchedCapture, prompts: list[list[int]]):
    """`(key, tensor)` -> HF's (float32, low-precision) rows for a batched capture key: each
    sequence of the key's step, teacher-forced on the engine's own tokens, its rows at the
    step's positions (the last one per sequence where the engine kept one row per sequence,
    the LM head)."""
    sequences = [_ids(run, prompts, s)[:-1] for s in range(len(prompts))]
    exact, low = _hf_sequences(ctx, sequences)
    steps = {layout.name(i): layout for i, layout in enumerate(run.steps)}

    def lookup(key: str, tensor: torch.Tensor):
        step, _, module = key.partition("/")
        if ":" in module or "#" in module or step not in steps:
            return None, None
        rows = tensor.shape[0]
        return (_gather(exact, module, steps[step], rows),
                None if low is None else _gather(low, module, steps[step], rows))

    return lookup


def _gather(per_sequence: list, module: str, layout: StepLayout,
            rows: int) -> torch.Tensor | None:
    """HF's rows of `module` for `layout`'s flat batch of `rows` rows (one per new token, or
    one per sequence); None where HF has no counterpart."""
    tokens = sum(q for _, _, q in layout.sequences)
    if rows not in (tokens, len(layout.sequences)):
        return None
    parts = []
    for seq, start, qlen in layout.sequences:
        names, acts, length = per_sequence[seq]
        t = names.lookup(acts, module, length)
        if t is None:
            return None
        parts.append(t[start : start + qlen] if rows == tokens else
                     t[start + qlen - 1 : start + qlen])
    return torch.cat(parts)


def _hf_sequences(ctx: CheckContext, sequences: list[list[int]]):
    """HF's activations on each of `sequences`, in float32 and (for a low-precision run) at
    the engine's dtype: per dtype a list of (NameMap, activations, length); HF loaded once per
    dtype, run once per model and sequences (`Baselines.hf_batched_activations`)."""
    return ctx.baselines.hf_batched_activations(sequences, lambda: _run_hf(ctx, sequences))


def _run_hf(ctx: CheckContext, sequences: list[list[int]]):
    cfg = ctx.case.model_config
    device = ctx.runner.placement.device_for(0)
    dtype = resolve_dtype(ctx.options.dtype, cfg)
    per_dtype = []
    for d in dict.fromkeys((torch.float32, dtype)):
        model = hf_model(ctx.case, ctx.options, d, device)
        runs = [hf_activations(model, ids) for ids in sequences]
        del model
        per_dtype.append([(NameMap(set(acts), cfg.num_attention_heads, cfg.head_dim), acts,
                           len(ids)) for acts, ids in zip(runs, sequences)])
    return per_dtype[0], (per_dtype[1] if len(per_dtype) > 1 else None)
