"""What a run's rows leave for its later rows, typed: per model a `Baselines` (the reference,
the engine at TP=1, HF's activations, bisect's localisation per TP size), and per run a
`RunState` (the saved reference's activations, which kernel matrices ran) that holds every
model's Baselines. The runner makes one RunState per run and hands it to every row's context.

Rows run TP size by TP size, ascending (`run_plan`), so what a TP=1 row records is there for
the same model's later TP sizes. Two kinds of member:
* recorded: a plain attribute the row that produces it sets (None, or empty, until then);
* lazy: a method that takes the builder and calls it on the first request only, so whichever
  check asks first pays and every later row reuses the value."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from freetoken_verify.cases.catalogue import Case
from freetoken_verify.checks.bisect.capture import Activations, BatchedCapture
from freetoken_verify.checks.bisect.table import Bisection
from freetoken_verify.reference.data import BisectActivations, Reference

Built = TypeVar("Built")


def _once(built: dict, key: Hashable, build: Callable[[], Built]) -> Built:
    """`built[key]`, calling `build` for it only when `key` has none yet."""
    if key not in built:
        built[key] = build()
    return built[key]


@dataclass
class Baselines:
    """One model's state across the run's TP sizes and checks."""

    tp1_outputs: dict | None = None
    """Recorded by golden's TP=1 row: the engine's outputs at TP=1 (rank 0's prompt logits,
    greedy ids and greedy-step logits per prompt) that golden compares later TP sizes with."""
    tp1_sampled: list[list[int]] | None = None
    """Recorded by golden's TP=1 row where its ranks agreed: the tokens each prompt's seeded
    continuation sampled at TP=1."""
    batched_matched: set[int] = field(default_factory=set)
    """Recorded by golden's passing rows: the TP sizes where its batched generation matched,
    where bisect has no batched divergence to look for."""
    tp1_activations: tuple[Activations, int] | None = None
    """Recorded at TP=1 by golden or bisect, whichever runs first: the engine's activations
    on the bisect prompt and the token its decode step consumed, compared module by module
    with later TP sizes'."""
    tp1_batched: BatchedCapture | None = None
    """Recorded by bisect's TP=1 batched capture: every step of the batched generation at
    TP=1, compared step by step with later TP sizes'."""
    _reference: dict = field(default_factory=dict, repr=False)
    _bisections: dict = field(default_factory=dict, repr=False)
    _batched_bisections: dict = field(default_factory=dict, repr=False)
    _hf_activations: dict = field(default_factory=dict, repr=False)
    _hf_batched_activations: dict = field(default_factory=dict, repr=False)

    def reference(self, build: Callable[[], Reference]) -> Reference:
        """The reference golden and bisect compare with (stored golden, saved or live HF),
        built once per model."""
        return _once(self._reference, None, build)

    def bisection(self, tp: int, build: Callable[[], Bisection]) -> Bisection:
        """bisect's localisation on its prompt at TP size `tp`, built once per TP size
        (golden's failing row and the bisect row share it)."""
        return _once(self._bisections, tp, build)

    def batched_bisection(self, tp: int, build: Callable[[], Bisection]) -> Bisection:
        """bisect's localisation of the batched generation at TP size `tp`, built once per
        TP size."""
        return _once(self._batched_bisections, tp, build)

    def hf_activations(self, ids: list[int], build: Callable[[], tuple]) -> tuple:
        """HF's activations on `ids` in float32 and at the run's dtype (each as (NameMap,
        activations); the second None in float32), built once per token sequence (the TP
        sizes whose decode step consumed the same token share it)."""
        return _once(self._hf_activations, tuple(ids), build)

    def hf_batched_activations(self, sequences: list[list[int]],
                               build: Callable[[], tuple]) -> tuple:
        """HF's activations on each of `sequences` (the prompts followed by the engine's own
        greedy tokens) in float32 and at the run's dtype, built once per set of sequences."""
        return _once(self._hf_batched_activations, tuple(map(tuple, sequences)), build)


@dataclass
class RunState:
    """One run's state: every model's Baselines, and what is shared across models."""

    kernel_matrices_ran: tuple[int, str] | None = None
    """Recorded by the first kernels row: (TP size, model) of the row that ran the kernel
    matrices, which hold every TP size's shapes and so run once per run."""
    kernel_models: set[str] = field(default_factory=set)
    """Recorded by kernels rows: the models whose own quantized GEMMs ran (once per model)."""
    _baselines: dict[str, Baselines] = field(default_factory=dict, repr=False)
    _saved_bisect: dict = field(default_factory=dict, repr=False)

    def baselines(self, case: Case) -> Baselines:
        """`case`'s Baselines (empty on its first row), by model name."""
        return self._baselines.setdefault(case.name, Baselines())

    def saved_bisect(self, folder: str | Path,
                     build: Callable[[], BisectActivations | None]) -> BisectActivations | None:
        """HF's activations the saved reference in `folder` holds (None where it holds
        none), read once per folder whatever the model."""
        return _once(self._saved_bisect, str(folder), build)
