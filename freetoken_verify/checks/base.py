"""What every check shares: the options, the context a check runs in (with the run's state,
`freetoken_verify.checks.state`), the helper that builds its result row, and the one table of
checks, whose run order follows from what each check needs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import import_module

from freetoken_verify.cases.catalogue import Case
from freetoken_verify.checks.ranks import RankRunner
from freetoken_verify.checks.state import Baselines, RunState
from freetoken_verify.report.formats import CheckResult


@dataclass(frozen=True)
class VerifyOptions:
    """Options shared by every check."""

    device: str = "auto"
    dtype: str = "auto"
    reference: str = "auto"
    num_layers: int | None = None
    oversubscribe: bool = False
    timeout: float = 600.0
    prompts_file: str | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    save_reference: str | None = None
    download: bool = False
    bitwise: bool = False
    kernel_matrices: bool = True
    """Whether `kernels` runs its Triton kernel matrices (False: only the quantized GEMMs,
    where nothing in the run can affect the Triton kernels; see `build_plan`)."""


@dataclass
class CheckContext:
    """One model at one TP size, the rank runner for that size, and the run's state that rows
    hand on to later rows (e.g. the TP=1 outputs later sizes are compared with)."""

    case: Case
    tp: int
    runner: RankRunner
    options: VerifyOptions
    state: RunState = field(default_factory=RunState)

    @property
    def placement(self) -> str:
        return self.runner.placement.name

    @property
    def baselines(self) -> Baselines:
        """This model's state across the run's TP sizes and checks."""
        return self.state.baselines(self.case)


def compared_engine_args(ctx: CheckContext) -> dict:
    """The engine golden and bisect compare across TP sizes: the case's, in the tp_invariant
    mode when the run is bitwise (`--bitwise`)."""
    args = ctx.case.engine_args(ctx.options)
    return {**args, "tp_invariant": True} if ctx.options.bitwise else args


def make_result(check: str, ctx: CheckContext, start: float, status: str,
                metrics: dict | None = None, message: str = "") -> CheckResult:
    """The result row of `check` on `ctx`'s model and TP size, timed from `start`
    (a `time.monotonic()` reading), with the context's placement."""
    return CheckResult(check, ctx.case.name, ctx.tp, status, time.monotonic() - start,
                       ctx.placement, metrics or {}, message)


@dataclass(frozen=True)
class CheckSpec:
    """One registered check: its entry point, the line `--list` prints for it, and the checks
    whose rows must come before its own where they run too (`needs`: what they leave in the
    run state, or on the ranks, this check reuses; a check runs without them)."""

    name: str
    module: str
    description: str
    needs: tuple[str, ...] = ()

    def load(self) -> Callable[[CheckContext], CheckResult]:
        """The check's `run(ctx)`; imported on demand, the check modules pull in torch."""

        return import_module(f"freetoken_verify.checks.{self.module}.check").run


class CheckTableError(ValueError):
    """The table of checks cannot be ordered: a check needs one the table lacks, or the
    needs form a cycle."""


def in_run_order(specs: Sequence[CheckSpec]) -> tuple[CheckSpec, ...]:
    """`specs` in the order they run: each after every check it needs, otherwise in table
    order. Raises CheckTableError naming a need the table lacks, or the checks in a cycle."""
    names = {spec.name for spec in specs}
    for spec in specs:
        for need in spec.needs:
            if need not in names:
                raise CheckTableError(f"check {spec.name!r} needs {need!r}, which is not in "
                                      f"the table of checks ({', '.join(sorted(names))})")
    ordered: list[CheckSpec] = []
    pending = list(specs)
    while pending:
        placed = {spec.name for spec in ordered}
        ready = next((s for s in pending if set(s.needs) <= placed), None)
        if ready is None:
            raise CheckTableError("the needs of checks " + ", ".join(
                f"{s.name!r} (needs {', '.join(s.needs)})" for s in pending) +
                " form a cycle: none can run first")
        ordered.append(ready)
        pending.remove(ready)
    return tuple(ordered)


# bisect reuses what golden recorded (the TP=1 activations, whether the batched generation
# matched); shards compares the engine memory loaded afresh under measurement.
CHECKS: tuple[CheckSpec, ...] = in_run_order((
    CheckSpec("golden", "golden",
              "prefill logits and greedy tokens against the reference (stored golden or live HF)"),
    CheckSpec("bisect", "bisect",
              "first layer and module where TP activations diverge from TP=1 and HF",
              needs=("golden",)),
    CheckSpec("memory", "memory",
              "per-rank peak memory, KV cache and state sizes, no pinned checkpoint views"),
    CheckSpec("shards", "shards",
              "every loaded parameter equals its shard of the checkpoint tensor, owning storage",
              needs=("memory",)),
    CheckSpec("kernels", "kernels",
              "NVFP4 kernels and every quantized GEMM against format oracles, engine kernels "
              "against their torch paths, at TP-local shapes (once per TP size)"),
    CheckSpec("collectives", "collectives",
              "every collective runs at its named place, with the expected shape and dtype"),
))

CHECK_NAMES: tuple[str, ...] = tuple(spec.name for spec in CHECKS)


def available_checks() -> dict[str, Callable[[CheckContext], CheckResult]]:
    """Check name -> run function, in the order they run."""
    return {spec.name: spec.load() for spec in CHECKS}
