"""bisect: the first module whose output diverges. Every rank records every module's output
on one prompt (its prefill, then one decode step); the parent rebuilds each full tensor from the
ranks' parts by its TP layout (`freetoken_verify.activations.engine`), requires replicated tensors
bitwise equal across ranks, and compares each module in execution order with (a) the engine at TP=1
and (b) HF transformers' same module (`freetoken_verify.activations.hf`; for a quantized checkpoint,
HF on its dequantized twin: `freetoken_verify.reference.twin`). The row names the first module
past its bound and how clean everything before it was. Where that prompt alone is clean,
the batched generation golden runs (every prompt decoding together) is localised the same way,
step by step (`freetoken_verify.checks.bisect.batched`): a bug that needs several sequences in
one step is named by that step and its first module.

Bounds (`freetoken_verify.compare.tolerances`): float32 1e-3 relative L2 everywhere. bf16 /
fp16: per module, 3x HF's own error at that dtype on that module (HF in low precision against
HF in float32), at least 2e-2, so a module is blamed only when the engine's rounding outgrows a
correct implementation's; where HF has no counterpart, the bound golden puts on the logits.

With `bitwise` (`--bitwise`) the engine runs in its tp_invariant mode and every module at TP=N
must equal TP=1 bit for bit (zero tolerance: the row names the first module that differs, how
many elements and the largest difference in ulps); HF is still compared within the bounds."""

from __future__ import annotations

import time

import torch

from freetoken.engine.core import resolve_dtype
from freetoken_verify.activations.hf import NameMap, hf_activations
from freetoken_verify.checks.base import CheckContext, compared_engine_args, make_result
from freetoken_verify.checks.bisect import batched
from freetoken_verify.checks.bisect.capture import Activations
from freetoken_verify.checks.bisect.capture import capture as capture_on
from freetoken_verify.checks.bisect.rows import build_rows, references
from freetoken_verify.checks.bisect.table import Bisection, Row, row_distance
from freetoken_verify.reference.sources import (
    bisect_prompt_of,
    hf_model,
    kept_bisect,
    prompts_for,
)
from freetoken_verify.report.formats import CheckResult

__all__ = ["Bisection", "Row", "row_distance", "run", "localise", "first_divergence"]


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    result = localise(ctx)
    # With no reference yet (TP=1 of a checkpoint HF cannot run), the batched capture is
    # still kept for the later TP sizes.
    # Golden's passing row at this TP size already compared the batched generation: a batched
    # capture there finds nothing (and costs more than the rest of the row).
    matched = ctx.tp in ctx.baselines.batched_matched
    found = batched.localise(ctx) if result.first is None and not matched else result
    metrics = {"modules": len(result.rows), "references": ",".join(result.references),
               "table": [r.as_dict() for r in result.rows]}
    if ctx.options.bitwise:
        metrics["bitwise"] = 1
    if found is not result:
        metrics.update(batched_modules=len(found.rows), batched_table=_step_rows(found))
    elif matched:
        metrics["batched"] = "golden's batched generation matched at this TP size"
    if not result.references:
        return make_result("bisect", ctx, start, "skip", metrics,
                       "no reference to bisect against: HF cannot run this checkpoint, and the "
                       "engine at TP=1 is not part of this run" if ctx.tp > 1 else
                       "no reference to bisect against at TP=1: HF cannot run this checkpoint")
    if found.first is not None:
        return make_result("bisect", ctx, start, "fail", metrics,
                       f"{ctx.case.name} tp={ctx.tp}: {found.message()}")
    return make_result("bisect", ctx, start, "pass", metrics, "")


def _step_rows(found: Bisection) -> list[dict]:
    """The batched table for the JSON row: the rows of the step where the first divergence
    is (every step of every module would be megabytes on a real checkpoint), else none."""
    if found.first is None:
        return []
    step = found.first.module.partition("/")[0]
    return [r.as_dict() for r in found.rows if r.module.partition("/")[0] == step]


def first_divergence(ctx: CheckContext) -> str:
    """The first divergence's words (`first divergence: <step/module> (...)`): on the bisect
    prompt, else on the batched generation; "" where neither finds one."""
    return localise(ctx).message() or batched.localise(ctx).message()


def localise(ctx: CheckContext) -> Bisection:
    """Capture this TP size's activations and compare them, module by module (once per model
    and TP size: golden's failure and the bisect check share `Baselines.bisection`)."""
    return ctx.baselines.bisection(ctx.tp, lambda: _localise(ctx))


def _localise(ctx: CheckContext) -> Bisection:
    prompt = bisect_prompt(ctx)
    if ctx.tp == 1:
        full, token = remember_tp1(ctx)
        tp1 = None
    else:
        full, token = capture(ctx, prompt)
        tp1 = ctx.baselines.tp1_activations
    if tp1 is not None and tp1[1] != token:
        # A different first token means the decode step saw other input: compare prefill only.
        full = {k: v for k, v in full.items() if not k.startswith("decode/")}
    hf, hf_low, hf_decode = _hf_references(ctx, prompt, token)
    return Bisection(_rows(full, tp1[0] if tp1 else None, hf, hf_low, ctx, len(prompt),
                           hf_decode), references(ctx, tp1 is not None, hf is not None))


def remember_tp1(ctx: CheckContext) -> tuple[Activations, int]:
    """At TP=1 (only), the engine's activations on the bisect prompt and its decode token,
    captured on the first call and kept as `Baselines.tp1_activations` for later TP sizes'
    localisation (golden calls this, so a golden failure at TP=N can name a module HF has no
    counterpart for)."""
    baselines = ctx.baselines
    if baselines.tp1_activations is None:
        baselines.tp1_activations = capture(ctx, bisect_prompt(ctx))
    return baselines.tp1_activations


def bisect_prompt(ctx: CheckContext) -> list[int]:
    """The longest reference prompt that one prefill step takes whole (at most 32 tokens)."""
    prompts, _ = prompts_for(ctx.case, ctx.options)
    return bisect_prompt_of(prompts)


def capture(ctx: CheckContext, prompt: list[int]) -> tuple[dict, int]:
    """Full activations (`phase/module` -> (tensor, disagreeing rank)) of this TP size on
    `prompt`, and the token its decode step consumed; the engine golden compares (in the
    tp_invariant mode when the run is bitwise)."""
    return capture_on(ctx.runner, compared_engine_args(ctx), prompt)


def _hf_references(ctx: CheckContext, prompt: list[int], token: int):
    """HF's activations on `prompt` + `token` in float32 and, for a low-precision engine, at
    its dtype (None where HF has none at that dtype), and whether the decode step's rows
    are comparable: from the ones the reference keeps (a saved reference's, a bundled case's
    golden in float32: `kept_bisect`; their token is HF's own first greedy token, so where
    the engine chose another only the prefill rows compare), else from HF run now."""
    saved = _saved_activations(ctx, prompt)
    if saved is not None:
        hf, hf_low, saved_token = saved
        return hf, hf_low, saved_token == token
    return (*hf_run(ctx, prompt + [token]), True)


def hf_run(ctx: CheckContext, ids: list[int]):
    """HF's activations on `ids` in float32 and at the engine's dtype (None in float32), each
    as (NameMap, activations); run once per model and ids (`Baselines.hf_activations`)."""
    return ctx.baselines.hf_activations(ids, lambda: _run_hf(ctx, ids))


def _saved_activations(ctx: CheckContext, prompt: list[int]):
    """(HF in float32, HF at the engine's dtype or None, HF's token) that the run's reference
    keeps; None where it keeps none for this prompt."""
    saved = kept_bisect(ctx.case, ctx.options, ctx.state)
    if saved is None or saved.prompt != prompt:
        return None
    cfg = ctx.case.model_config
    names = NameMap(set(saved.by_dtype["float32"]), cfg.num_attention_heads, cfg.head_dim)
    dtype = str(resolve_dtype(ctx.options.dtype, cfg)).removeprefix("torch.")
    low = saved.by_dtype.get(dtype) if dtype != "float32" else None
    return (names, saved.by_dtype["float32"]), (None if low is None else (names, low)), \
        saved.token


def _run_hf(ctx: CheckContext, ids: list[int]):
    device = ctx.runner.placement.device_for(0)
    dtype = resolve_dtype(ctx.options.dtype, ctx.case.model_config)
    acts = []
    for d in dict.fromkeys((torch.float32, dtype)):
        model = hf_model(ctx.case, ctx.options, d, device)
        acts.append(hf_activations(model, ids))
        del model
    names = NameMap(set(acts[0]), ctx.case.model_config.num_attention_heads,
                    ctx.case.model_config.head_dim)
    return (names, acts[0]), ((names, acts[1]) if len(acts) > 1 else None)


def _rows(full, tp1, hf, hf_low, ctx, prompt_len: int, hf_decode: bool = True) -> list[Row]:
    """The per-module table of the bisect prompt; HF's decode-step rows are left out where
    `hf_decode` is False (HF's saved step consumed another token than the engine's)."""

    def hf_for(key: str, tensor: torch.Tensor):
        if not hf_decode and not key.startswith("prefill/"):
            return None, None
        width = tensor.shape[1]
        return (_hf_tensor(hf, key, prompt_len, width),
                _hf_tensor(hf_low, key, prompt_len, width))

    return build_rows(full, tp1, hf_for, ctx)


def _hf_tensor(hf, key: str, prompt_len: int, width: int | None = None
               ) -> torch.Tensor | None:
    """HF's activation for an engine capture key: prompt rows for prefill, the last row for
    the decode step; None for partial sums and repeated calls (no HF counterpart)."""
    if hf is None or ":" in key or "#" in key:
        return None
    phase, _, module = key.partition("/")
    names, acts = hf
    t = names.lookup(acts, module, len(next(iter(acts.values()))), width)
    if t is None:
        return None
    return t[:prompt_len] if phase == "prefill" else t[prompt_len:]


