"""Records every collective an engine step issues on this rank, attributed to the innermost
module running when it was issued (or to the engine itself, outside the model).

A `RecordingCommunicator` wraps the rank's Communicator for the duration of a traced
generation; forward pre/post hooks on every module of the model keep a stack of module
names, and the engine's sampler (`EngineCore._sample`) counts as one more module, so its
broadcast is told from anything else issued outside the model. A step starts at each forward
of the model's root module; the LM head gather and the sampler's broadcast that follow it
belong to the same step. The traced generation samples at a high temperature from a fixed
seed and keeps the tokens every step ended with on this rank: ranks that do not take rank 0's
tokens show as ranks that went on with other tokens."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from freetoken.distributed import Communicator, get_communicator, set_communicator
from freetoken.engine.sequence import SamplingParams

ENGINE = "(engine, outside the model)"
SAMPLER = "sampler (EngineCore._sample)"
TRACE_SEED = 1234
TRACE_TEMPERATURE = 100.0
"""The traced generation's sampling: near uniform over the vocabulary, so two ranks that
sample on their own (from different generators) pick other tokens: two tokens from 301
agree by chance once in 90 000 draws."""


@dataclass(frozen=True)
class Call:
    """One collective: its kind, the shape and dtype of the tensor handed to it, all_gather's
    dim (non-negative) and the input's storage, which tells one tensor reduced twice from two
    tensors reduced once each."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    dim: int | None = None
    storage: int = 0

    def describe(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        along = f" along dim {self.dim}" if self.dim is not None else ""
        return f"{self.kind} of [{dims}] {self.dtype}{along}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_call(kind: str, x: torch.Tensor, dim: int | None = None) -> Call:
    if dim is not None:
        dim = dim % max(x.dim(), 1)
    return Call(kind, tuple(x.shape), dtype_name(x.dtype), dim, x.untyped_storage().data_ptr())


class RecordingCommunicator(Communicator):
    """Passes every call on to `inner` after reporting it to `record`."""

    def __init__(self, inner: Communicator, record: Callable[[Call], None]):
        super().__init__(inner.size)
        self.inner, self.record = inner, record

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.record(make_call("all_reduce", x))
        return self.inner.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.record(make_call("all_gather", x, dim))
        return self.inner.all_gather(x, dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.record(make_call("broadcast", x))
        return self.inner.broadcast(x, src)


@dataclass
class Step:
    """What one engine step issued: module name -> its calls in order, how often each module
    ran, and the shape of the first tensor argument of each module's first forward."""

    calls: dict[str, list[Call]] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


class Trace:
    """Hooks on every module of `model` plus the recording communicator; `steps` fills in as
    the engine runs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.steps: list[Step] = []
        self.tokens: list[list[int]] = []
        """The tokens the sampler returned on this rank, one list per step."""
        self._stack: list[str] = []

    def record(self, call: Call) -> None:
        if not self.steps:
            self.steps.append(Step())
        owner = self._stack[-1] if self._stack else ENGINE
        self.steps[-1].calls.setdefault(owner, []).append(call)

    def _enter(self, name: str, args: tuple) -> None:
        if name == "":
            self.steps.append(Step())
        step = self.steps[-1]
        step.runs[name] = step.runs.get(name, 0) + 1
        if args and isinstance(args[0], torch.Tensor):
            step.input_shapes.setdefault(name, tuple(args[0].shape))
        self._stack.append(name)

    def _leave(self) -> None:
        self._stack.pop()

    def sampler(self, sample: Callable) -> Callable:
        """`sample` (an engine's bound `_sample`) with its calls attributed to SAMPLER and
        the tokens it returns kept."""
        def traced(batch, logits, *rest):
            if self.steps:
                runs = self.steps[-1].runs
                runs[SAMPLER] = runs.get(SAMPLER, 0) + 1
            self._stack.append(SAMPLER)
            try:
                tokens = sample(batch, logits, *rest)
            finally:
                self._stack.pop()
            self.tokens.append(list(tokens))
            return tokens
        return traced

    @contextmanager
    def installed(self):
        """Hooks on, the rank's communicator wrapped; both undone on exit."""
        inner = get_communicator()
        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: self._enter(name, args)))
            handles.append(module.register_forward_hook(lambda m, args, out: self._leave()))
        set_communicator(RecordingCommunicator(inner, self.record))
        try:
            yield self
        finally:
            set_communicator(inner)
            for handle in handles:
                handle.remove()
            self._stack.clear()


def trace_generation(core, prompt: list[int], max_tokens: int = 2) -> list[Step]:
    """Run `prompt` through the rank's engine `core` (one prefill step, then decode steps up
    to `max_tokens`) with every collective recorded; returns the steps in order."""
    return traced_run(core, prompt, max_tokens).steps


def traced_run(core, prompt: list[int], max_tokens: int = 2) -> Trace:
    """`trace_generation`'s run, with the tokens the sampler returned at each step
    (`Trace.tokens`): sampled at TRACE_TEMPERATURE from TRACE_SEED."""
    trace = Trace(core.model)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            temperature=TRACE_TEMPERATURE, seed=TRACE_SEED)
    core._sample = trace.sampler(core._sample)
    try:
        with trace.installed():
            core.generate([prompt], [params])
    finally:
        del core._sample
    return trace
