"""bisect's captures: every module's output on every rank, rebuilt in the parent into the full
tensor a TP=1 engine would have produced (`freetoken_verify.activations.engine`), for one
prompt (its prefill and one decode step) or for the batched generation golden runs (every
prompt, every step, with the sequences and positions each step held)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from freetoken.engine.sequence import SamplingParams
from freetoken_verify.activations.engine import FULL, PARTIAL, Recorder, unshard
from freetoken_verify.checks.engine_cache import engine_on_rank


class Activation(NamedTuple):
    """One module's full output: the tensor, the first rank whose replicated copy differs
    from rank 0's (None: none, or not replicated) and whether the parent summed it from the
    ranks' partial sums (its bits are then the parent's arithmetic, not the engine's)."""

    tensor: torch.Tensor
    disagree: int | None = None
    summed: bool = False


Activations = dict[str, Activation]
"""`phase/module` -> its Activation."""


@dataclass(frozen=True)
class StepLayout:
    """One engine step of a batched capture: prefill or decode, and per sequence (request id,
    first position, new tokens) in the order of the step's flat batch."""

    prefill: bool
    sequences: tuple[tuple[int, int, int], ...]

    def name(self, index: int) -> str:
        ids = ", ".join(str(s) for s, _, _ in self.sequences)
        kind = "prefill" if self.prefill else "decode"
        plural = "s" if len(self.sequences) > 1 else ""
        return f"batched step {index} ({kind} of prompt{plural} {ids})"


@dataclass(frozen=True)
class BatchedCapture:
    """The full activations of a batched generation, its steps and each prompt's tokens."""

    full: Activations
    steps: tuple[StepLayout, ...]
    tokens: tuple[tuple[int, ...], ...]


def capture(runner, engine_args: dict, prompt: list[int]) -> tuple[Activations, int]:
    """Full activations of `prompt`'s prefill and one decode step on `runner`'s ranks, and
    the token the decode step consumed."""
    records = runner.run(_capture_on_rank, engine_args, prompt)
    return _rebuild([r.value["captures"] for r in records]), records[0].value["token"]


def capture_batched(runner, engine_args: dict, prompts: list[list[int]],
                    num_tokens: int) -> BatchedCapture:
    """Full activations of every step of the greedy generation of `prompts` together
    (`num_tokens` each), as golden runs it."""
    records = runner.run(_capture_batched_on_rank, engine_args, prompts, num_tokens)
    first = records[0].value
    return BatchedCapture(_rebuild([r.value["captures"] for r in records]),
                          tuple(first["steps"]), tuple(map(tuple, first["tokens"])))


def _rebuild(per_rank_captures: list[list]) -> Activations:
    per_rank = [{key: (layout, t) for key, layout, t in captures}
                for captures in per_rank_captures]
    full = {}
    for key, (layout, _) in per_rank[0].items():
        parts = [ranks[key][1] for ranks in per_rank]
        full[key] = Activation(unshard(layout, parts), _disagreeing_rank(layout, parts),
                               layout == PARTIAL)
    return full


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
    try:
        with _eager(core):
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            result = core.generate([prompt], [params])[0]
    finally:
        pre.remove()
        recorder.remove()
    return {"captures": [(c.key, c.layout, c.tensor) for c in recorder.captures],
            "token": result.token_ids[0]}


def _capture_batched_on_rank(rank_ctx, engine_args: dict, prompts: list[list[int]],
                             num_tokens: int) -> dict:
    """Runs on every rank: the greedy generation of `prompts` together, every module of every
    step recorded under the step's name, with each step's sequences and positions."""
    core = engine_on_rank(rank_ctx, engine_args)
    recorder = Recorder(core.model, core.model_config, rank_ctx.size)
    steps: list[StepLayout] = []
    step = core.step

    def recorded_step(batch, prefill):
        layout = StepLayout(prefill, tuple((s.seq_id, s.num_cached, len(s) - s.num_cached)
                                           for s in batch))
        recorder.phase(layout.name(len(steps)), sum(q for _, _, q in layout.sequences))
        steps.append(layout)
        return step(batch, prefill)

    core.step = recorded_step
    try:
        with _eager(core):
            params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
            results = core.generate(prompts, [params] * len(prompts))
    finally:
        del core.step
        recorder.remove()
    return {"captures": [(c.key, c.layout, c.tensor) for c in recorder.captures],
            "steps": steps, "tokens": [r.token_ids for r in results]}


@contextmanager
def _eager(core) -> Iterator[None]:
    """Decode steps run eagerly while recording: a replayed CUDA graph runs no Python, so no
    hook would see it; replay is bitwise equal to the eager step
    (tests/engine/test_cuda_engine.py)."""
    graphs, core.graphs = getattr(core, "graphs", None), None
    try:
        yield
    finally:
        core.graphs = graphs
