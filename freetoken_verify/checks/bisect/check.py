"""bisect: the first module whose output diverges. Every rank records every module's output
on one prompt (its prefill, then one decode step); the parent rebuilds each full tensor from the
ranks' parts by its TP layout (`freetoken_verify.activations.engine`), requires replicated tensors
bitwise equal across ranks, and compares each module in execution order with (a) the engine at TP=1
and (b) HF transformers' same module (`freetoken_verify.activations.hf`; for a quantized checkpoint,
HF on its dequantized twin: `freetoken_verify.reference.twin`). The row names the first module
past its bound and how clean everything before it was.

Bounds: float32 1e-3 relative L2 everywhere. bf16 / fp16: per module, 3x HF's own error at
that dtype on that module (HF in low precision against HF in float32), at least 2e-2, so a
module is blamed only when the engine's rounding outgrows a correct implementation's; where HF
has no counterpart, the bound golden puts on the logits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

import freetoken_verify.compare as compare
from freetoken.engine.core import resolve_dtype
from freetoken.engine.sequence import SamplingParams
from freetoken_verify.activations.engine import FULL, Recorder, unshard
from freetoken_verify.activations.hf import NameMap, hf_activations
from freetoken_verify.checks.base import CheckContext, make_result
from freetoken_verify.checks.engine_cache import engine_on_rank
from freetoken_verify.reference.sources import (
    bisect_prompt_of,
    hf_model,
    prompts_for,
    reference_for,
    reference_source,
    stored_dir,
)
from freetoken_verify.reference.store import stored_bisect
from freetoken_verify.report.formats import CheckResult

FP32_BOUND = 1e-3
LOW_FLOOR, LOW_FACTOR = 2e-2, 3.0


@dataclass
class Row:
    """One module's output compared with the references (None: no such reference)."""

    module: str
    vs_tp1: float | None = None
    vs_hf: float | None = None
    bound: float = FP32_BOUND
    ranks_disagree: int | None = None
    shape_vs_tp1: tuple | None = None

    @property
    def worst(self) -> float:
        return max((v for v in (self.vs_tp1, self.vs_hf) if v is not None), default=0.0)

    @property
    def diverged(self) -> bool:
        return (self.ranks_disagree is not None or self.shape_vs_tp1 is not None
                or self.worst > self.bound)

    def as_dict(self) -> dict:
        return {"module": self.module, "vs_tp1": self.vs_tp1, "vs_hf": self.vs_hf,
                "bound": self.bound, "ranks_disagree": self.ranks_disagree,
                "shape_vs_tp1": self.shape_vs_tp1}


@dataclass
class Bisection:
    """Every compared module in execution order, and which references were available."""

    rows: list[Row] = field(default_factory=list)
    references: tuple[str, ...] = ()

    @property
    def first(self) -> Row | None:
        return next((r for r in self.rows if r.diverged), None)

    def message(self) -> str:
        row = self.first
        if row is None:
            return ""
        earlier = [r.worst for r in self.rows[: self.rows.index(row)]]
        clean = f"earlier modules <= {max(earlier):.1e}" if earlier else "the first module"
        return f"first divergence: {row.module} ({_describe(row)}; {clean})"


def _describe(row: Row) -> str:
    if row.ranks_disagree is not None:
        return f"rank {row.ranks_disagree} holds a different replicated tensor than rank 0"
    if row.shape_vs_tp1 is not None:
        return f"shape {row.shape_vs_tp1[0]} where TP=1 has {row.shape_vs_tp1[1]}"
    parts = [f"rel L2 {_fmt(v)} vs {ref}" for ref, v in (("TP=1", row.vs_tp1), ("HF", row.vs_hf))
             if v is not None and v > row.bound]
    return ", ".join(parts) + f", bound {row.bound:.1e}"


def _fmt(v: float) -> str:
    return "NaN/Inf" if not math.isfinite(v) else f"{v:.2g}"


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    result = localise(ctx)
    metrics = {"modules": len(result.rows), "references": ",".join(result.references),
               "table": [r.as_dict() for r in result.rows]}
    if not result.references:
        return make_result("bisect", ctx, start, "skip", metrics,
                       "no reference to bisect against: HF cannot run this checkpoint, and the "
                       "engine at TP=1 is not part of this run" if ctx.tp > 1 else
                       "no reference to bisect against at TP=1: HF cannot run this checkpoint")
    if result.first is not None:
        return make_result("bisect", ctx, start, "fail", metrics,
                       f"{ctx.case.name} tp={ctx.tp}: {result.message()}")
    return make_result("bisect", ctx, start, "pass", metrics, "")



def localise(ctx: CheckContext) -> Bisection:
    """Capture this TP size's activations and compare them, module by module (once per model
    and TP size: golden's failure and the bisect check share it)."""
    key = ("bisect", ctx.case.name, ctx.tp)
    if key not in ctx.cache:
        ctx.cache[key] = _localise(ctx)
    return ctx.cache[key]


def _localise(ctx: CheckContext) -> Bisection:
    prompt = bisect_prompt(ctx)
    full, token = capture(ctx, prompt)
    tp1 = ctx.cache.get(("bisect-tp1", ctx.case.name))
    if ctx.tp == 1:
        ctx.cache[("bisect-tp1", ctx.case.name)] = (full, token)
        tp1 = None
    elif tp1 is not None and tp1[1] != token:
        # A different first token means the decode step saw other input: compare prefill only.
        full = {k: v for k, v in full.items() if not k.startswith("decode/")}
    hf, hf_low, hf_decode = _hf_references(ctx, prompt, token)
    refs = tuple(n for n, ok in (("TP=1", tp1 is not None), ("HF", hf is not None)) if ok)
    return Bisection(_rows(full, tp1[0] if tp1 else None, hf, hf_low, ctx, len(prompt),
                           hf_decode), refs)


def remember_tp1(ctx: CheckContext) -> None:
    """At TP=1, keep the engine's activations for later TP sizes' localisation (golden calls
    this, so a golden failure at TP=N can name a module HF has no counterpart for)."""
    key = ("bisect-tp1", ctx.case.name)
    if ctx.tp == 1 and key not in ctx.cache:
        ctx.cache[key] = capture(ctx, bisect_prompt(ctx))


def bisect_prompt(ctx: CheckContext) -> list[int]:
    """The longest reference prompt that one prefill step takes whole (at most 32 tokens)."""
    prompts, _ = prompts_for(ctx.case, ctx.options)
    return bisect_prompt_of(prompts)


def capture(ctx: CheckContext, prompt: list[int]) -> tuple[dict, int]:
    """Full activations (`phase/module` -> (layout, tensor, disagreeing rank)) of this TP
    size on `prompt`, and the token its decode step consumed."""
    records = ctx.runner.run(_capture_on_rank, ctx.case.engine_args(ctx.options), prompt)
    per_rank = [{key: (layout, t) for key, layout, t in r.value["captures"]} for r in records]
    full = {}
    for key, (layout, _) in per_rank[0].items():
        parts = [ranks[key][1] for ranks in per_rank]
        full[key] = (unshard(layout, parts), _disagreeing_rank(layout, parts))
    return full, records[0].value["token"]


def _disagreeing_rank(layout, parts) -> int | None:
    if layout != FULL:
        return None
    return next((r for r, p in enumerate(parts[1:], 1) if not torch.equal(p, parts[0])), None)


def _capture_on_rank(rank_ctx, engine_args: dict, prompt: list[int]) -> dict:
    """Runs on every rank: prefill `prompt` and decode one token with every module recorded."""

    core = engine_on_rank(rank_ctx, engine_args)
    recorder = Recorder(core.model, core.model_config, rank_ctx.size)
    phases = iter(("prefill", "decode"))
    pre = core.model.register_forward_pre_hook(
        lambda m, args: recorder.phase(next(phases, "late"), args[0].numel()))
    # A replayed CUDA graph runs no Python, so no hook would see the decode step; replay is
    # bitwise equal to the eager step (tests/engine/test_cuda_engine.py), so record eagerly.
    graphs, core.graphs = getattr(core, "graphs", None), None
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        result = core.generate([prompt], [params])[0]
    finally:
        core.graphs = graphs
        pre.remove()
        recorder.remove()
    return {"captures": [(c.key, c.layout, c.tensor) for c in recorder.captures],
            "token": result.token_ids[0]}


def _hf_references(ctx: CheckContext, prompt: list[int], token: int):
    """HF's activations on `prompt` + `token` in float32 and, for a low-precision engine, at
    its dtype (None where HF has none at that dtype), and whether the decode step's rows
    are comparable: from a saved reference when it holds them (its token is HF's own first
    greedy token: where the engine chose another, only the prefill rows compare), else from
    HF run now."""
    saved = _saved_activations(ctx, prompt)
    if saved is not None:
        hf, hf_low, saved_token = saved
        return hf, hf_low, saved_token == token
    key = ("bisect-hf", ctx.case.name, tuple(prompt + [token]), ctx.options.dtype)
    if key not in ctx.cache:
        ctx.cache[key] = _run_hf(ctx, prompt + [token])
    return (*ctx.cache[key], True)


def _saved_activations(ctx: CheckContext, prompt: list[int]):
    """(HF in float32, HF at the engine's dtype or None, HF's token) from the run's saved
    reference; None where it has none for this prompt."""
    folder = stored_dir(ctx.options)
    if folder is None:
        return None
    key = ("bisect-saved", folder)
    if key not in ctx.cache:
        ctx.cache[key] = stored_bisect(folder)
    saved = ctx.cache[key]
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
    """The per-module table; HF's decode-step rows are left out where `hf_decode` is False
    (HF's saved step consumed another token than the engine's)."""
    low = resolve_dtype(ctx.options.dtype, ctx.case.model_config) != torch.float32
    fallback = _logit_bound(ctx) if low else FP32_BOUND
    rows = []
    for key, (tensor, disagree) in full.items():
        exact, rounded = (hf, hf_low) if hf_decode or key.startswith("prefill/") else (None, None)
        row = Row(key, ranks_disagree=disagree)
        if tp1 is not None and key in tp1:
            if tp1[key][0].shape == tensor.shape:
                row.vs_tp1 = rel_l2(tensor, tp1[key][0])
            else:
                row.shape_vs_tp1 = (tuple(tensor.shape), tuple(tp1[key][0].shape))
        hf_t = _rows_like(_hf_tensor(exact, key, prompt_len, tensor.shape[1]), tensor)
        if hf_t is not None and hf_t.shape == tensor.shape:
            row.vs_hf = rel_l2(tensor, hf_t)
        if low:
            row.bound = _low_bound(exact, rounded, key, prompt_len, fallback)
        if row.vs_tp1 is not None or row.vs_hf is not None or row.diverged:
            rows.append(row)
    return rows


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


def _rows_like(hf_t: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor | None:
    """The engine runs the LM head on a prefill's last token only: HF's last row then."""
    if hf_t is not None and tensor.shape[0] == 1 and hf_t.shape[0] > 1:
        return hf_t[-1:]
    return hf_t


def _logit_bound(ctx: CheckContext) -> float:
    """Without HF at the engine's dtype, a module may differ from TP=1 by as much as golden
    lets the logits differ (for a bundled case: its stored low-precision baseline)."""

    dtype = resolve_dtype(ctx.options.dtype, ctx.case.model_config)
    baseline = None
    if reference_source(ctx.case, ctx.options) == "golden":
        # The run's stored reference, loaded once and shared with golden.
        stored = reference_for(ctx).baseline
        baseline = stored[0] if stored else None
    return compare.effective_tolerance(dtype, baseline).max_rel_l2


def _low_bound(hf, hf_low, key: str, prompt_len: int, fallback: float) -> float:
    if hf is None or hf_low is None:
        return fallback
    exact = _hf_tensor(hf, key, prompt_len)
    low = _hf_tensor(hf_low, key, prompt_len)
    if exact is None or low is None or exact.shape != low.shape:
        return fallback
    return max(LOW_FLOOR, LOW_FACTOR * rel_l2(low, exact))


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (inf where `actual` is not finite)."""
    a, e = actual.double(), expected.double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    ref = float(e.norm())
    err = float((a - e).norm())
    return err / max(ref, 1e-12 * math.sqrt(e.numel()) + 1e-30)
