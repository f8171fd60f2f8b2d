"""collectives: every collective one prefill step and one decode step issue, per module, against
the collectives the TP conventions put in the model's layer structure; and the Communicator
itself on inputs of every layout, with exact expected results.

Expected collectives come from module types and layout
(`freetoken_verify.checks.collectives.sites`), recorded ones from a traced generation
(`freetoken_verify.checks.collectives.trace`). A module that issues fewer, more or differently
shaped collectives than its site fails the row, named. Every rank must also end each traced
step with the tokens rank 0 sampled: a rank that went on with others is named, on the
sampler's line. At TP=1 the Communicator is the identity (and
the embedding skips it), so the per-module counts are reported but not compared; the Communicator
probe still runs and must return its input unchanged."""

from __future__ import annotations

import time

from freetoken.distributed import get_communicator
from freetoken_verify.checks.base import CheckContext, make_result
from freetoken_verify.checks.collectives.probe import probe_cases, probe_communicator
from freetoken_verify.checks.collectives.sites import Site, expected_sites, inside_note, moe_blocks
from freetoken_verify.checks.collectives.trace import (
    ENGINE,
    SAMPLER,
    TRACE_SEED,
    Call,
    Step,
    traced_run,
)
from freetoken_verify.checks.engine_cache import engine_on_rank
from freetoken_verify.reference.sources import prompts_for
from freetoken_verify.report.formats import CheckResult

KINDS = ("all_reduce", "all_gather", "broadcast")
# The JSON report lists this many failure lines; the row message carries the first.
_LISTED = 20


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    prompt = prompts_for(ctx.case, ctx.options)[0][0]
    ranks = [r.value for r in ctx.runner.run(_on_rank, ctx.case.engine_args(ctx.options),
                                             prompt)]
    problems = _with_sampler(_merge([r["problems"] for r in ranks], ctx.tp),
                             _tokens_disagree([r["tokens"] for r in ranks]))
    probe = _merge([r["probe"] for r in ranks], ctx.tp)
    seen, want = ranks[0]["counts"]
    metrics = {**seen, "problems": len(problems), "comm_failed": len(probe),
               "comm_cases": ranks[0]["comm_cases"], **want, "counts_compared": ctx.tp > 1,
               "per_step": ranks[0]["per_step"]}
    failures = probe + problems
    head = f"{ctx.case.name} tp={ctx.tp}: "
    if failures:
        metrics["failures"] = failures[:_LISTED]
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return make_result("collectives", ctx, start, "fail", metrics, head + failures[0] + more)
    note = "" if ctx.tp > 1 else ("counts not compared: the Communicator is the identity at "
                                  "TP=1; Communicator probe passed")
    return make_result("collectives", ctx, start, "pass", metrics, head + note if note else "")



def _merge(per_rank: list[list[tuple[str, str]]], size: int) -> list[str]:
    """(headline, evidence) problems in first-seen order, one line per headline with the
    first rank's evidence; a headline not seen on every rank names its ranks."""
    seen: dict[str, list] = {}
    for rank, problems in enumerate(per_rank):
        for headline, evidence in problems:
            seen.setdefault(headline, [evidence, []])[1].append(rank)
    lines = []
    for headline, (evidence, ranks) in seen.items():
        where = "" if len(ranks) == size else f" on rank {', '.join(map(str, ranks))}"
        lines.append(headline + (f" ({evidence})" if evidence else "") + where)
    return lines


def _tokens_disagree(tokens: list[list[list[int]]]) -> str | None:
    """`rank R went on with [..] where rank 0 sampled [..]` for the first rank whose steps
    ended with other tokens than rank 0's (every rank must take rank 0's broadcast)."""
    for rank, mine in enumerate(tokens):
        if mine != tokens[0]:
            ours = [t for step in mine for t in step]
            first = [t for step in tokens[0] for t in step]
            return (f"rank {rank} went on with tokens {ours} where rank 0 sampled {first} "
                    f"(seed {TRACE_SEED})")
    return None


def _with_sampler(problems: list[str], disagree: str | None) -> list[str]:
    """The sampler's disagreement joins the sampler's own problem line (a missing broadcast
    says why the ranks disagree), else leads as a line of its own."""
    if disagree is None:
        return problems
    head = f"{SAMPLER}: "
    for i, line in enumerate(problems):
        if line.startswith(head):
            return [*problems[:i], f"{head}{disagree}; {line[len(head):]}", *problems[i + 1:]]
    return [head + disagree, *problems]


def _on_rank(rank_ctx, engine_args: dict, prompt: list[int]) -> dict:
    """Runs on every rank: the Communicator probe, then one traced prefill + decode step."""

    core = engine_on_rank(rank_ctx, engine_args)
    probe = probe_communicator(get_communicator(), rank_ctx.rank, rank_ctx.size, core.device)
    trace = traced_run(core, prompt)
    steps = trace.steps
    sites = expected_sites(core.model, core.dtype, batch=1)
    problems = compare_steps(steps, sites, moe_blocks(core.model), core.model) \
        if rank_ctx.size > 1 else []
    per_step = [{"step": _step_name(s, i), **_step_counts(s)} for i, s in enumerate(steps)]
    return {"probe": probe, "problems": problems, "comm_cases": len(probe_cases()),
            "counts": _counts(steps, sites), "per_step": per_step, "tokens": trace.tokens}


def _step_name(step: Step, index: int) -> str:
    tokens = step.input_shapes.get("model.embed_tokens", (0,))[0]
    return f"prefill ({tokens} tokens)" if index == 0 else "decode"


def _step_counts(step: Step) -> dict:
    calls = [c for cs in step.calls.values() for c in cs]
    return {kind: sum(c.kind == kind for c in calls) for kind in KINDS}


def _counts(steps: list[Step], sites: dict[str, Site]) -> tuple[dict, dict]:
    """Calls seen per kind over all steps, and the numbers the sites imply."""
    seen = {kind: sum(_step_counts(s)[kind] for s in steps) for kind in KINDS}
    want = {f"expected_{kind}": len(steps) * sum(s.count for s in sites.values() if s.kind == kind)
            for kind in KINDS}
    return seen, want


def compare_steps(steps: list[Step], sites: dict[str, Site], blocks: dict[str, str],
                  model) -> list[tuple[str, str]]:
    """Recorded `steps` (the first a prefill) against the `sites` of `model` (`blocks`: its
    MoE blocks, see `moe_blocks`): one (line, '') per module problem, in module order, naming
    the steps it occurred in."""
    order = [name for name, _ in model.named_modules()] + [SAMPLER, ENGINE]
    found: dict[str, list[str]] = {}
    for index, step in enumerate(steps):
        for name in order:
            for line in _module_problems(name, step, sites.get(name), blocks):
                found.setdefault(line, []).append(_step_name(step, index))
    return [(f"{line} in {' and '.join(where)}", "") for line, where in found.items()]


def _module_problems(name: str, step: Step, site: Site | None, blocks) -> list[str]:
    calls = step.calls.get(name, [])
    problems = []
    for kind in KINDS:
        want = site.count if site is not None and site.kind == kind else 0
        got = [c for c in calls if c.kind == kind]
        if len(got) != want:
            problems.append(f"{name}: expected {want} {kind} per forward, saw {len(got)} "
                            f"({_why(name, want, got, site, step, blocks)})")
    if not problems and site is not None:
        problems += _shape_problems(name, step, site, calls)
    return problems


def _why(name: str, want: int, got: list[Call], site: Site | None, step: Step, blocks) -> str:
    """Words for a count mismatch: missing, extra or doubled, and the likely cause."""
    if want and not got:
        ran = step.runs.get(name, 0)
        reason = (site.note or site.why) if ran else "the module did not run"
        return f"missing: {reason}"
    if want and len(got) == 2 * want:
        return f"doubled: {_doubled(got)}"
    if not want:
        where = inside_note(name, blocks)
        return f"extra: {where}" if where else "extra: no TP convention puts one here"
    return f"{len(got) - want} extra" if len(got) > want else f"{want - len(got)} missing"


def _doubled(got: list[Call]) -> str:
    """One tensor handed over twice, or several (for all_reduce: partial sums reduced one by
    one)."""
    distinct = len({c.storage for c in got})
    verb = {"all_reduce": "reduced", "all_gather": "gathered"}.get(got[0].kind, "broadcast")
    if distinct < len(got):
        return f"the same tensor {verb} twice"
    if got[0].kind == "all_reduce":
        return (f"{distinct} different tensors, partial sums reduced separately instead of "
                "added and reduced once")
    return f"{distinct} different tensors {verb}"


def _shape_problems(name: str, step: Step, site: Site, calls: list[Call]) -> list[str]:
    want = site.expected(step.input_shapes.get(name) if name not in (SAMPLER, ENGINE) else ())
    if want is None:
        return []
    return [f"{name}: expected {want.describe()}, saw {c.describe()}" for c in calls
            if (c.kind, c.shape, c.dtype, c.dim) != (want.kind, want.shape, want.dtype, want.dim)]
