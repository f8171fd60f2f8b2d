"""The public API: `LLM(model, tp=2).generate(prompts, SamplingParams(...))`.

TP=1 runs in this process; TP>1 starts one process per rank once. Either way one driver
thread steps the engine for every calling thread (`freetoken.engine.driver`); at TP>1 each
round of steps goes to all ranks and rank 0's finished results come back."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.distributed import RankContext, RankGroup, choose_placement, get_tp_info
from freetoken.engine.core import EngineCore
from freetoken.engine.driver import Driver, LLMClosed
from freetoken.engine.options import check_launch, check_overlap, engine_config
from freetoken.engine.requests import Limits, check_request, split_prompts, token_ids
from freetoken.engine.resolve import resolve_model
from freetoken.engine.sequence import GenerationResult, Request, SamplingParams, default_seed
from freetoken.loading.screen import screen_checkpoint
from freetoken.loading.validate import validate_checkpoint
from freetoken.models.registry import check_tp, load_config

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank group waits for a rank to start or answer before it names the hung rank."""
STEPS_PER_CALL = 8
"""Engine steps the ranks run per round trip (fewer when a request finishes sooner): a
request submitted meanwhile waits at most this many steps to join the batch."""


class LLM:
    """A loaded model at some TP size; use as a context manager or call `shutdown()`.

    Safe to share between threads: concurrent `generate` calls join one continuous batch and
    each gets exactly its own results (see `freetoken.engine.driver`). `shutdown()` fails the
    calls still in flight, and every later call, with `LLMClosed`."""

    def __init__(self, model: str | Path, tp: int = 1, device: str = "auto",
                 dtype: str = "auto", oversubscribe: bool = False, in_process: bool | None = None,
                 timeout: float = DEFAULT_TIMEOUT, **engine_options: Any):
        self.folder = resolve_model(model)
        # Parsed and validated once, here; the ranks get this object, not the file.
        self.model_config = load_config(self.folder)
        check_launch(tp, oversubscribe, timeout)
        self.tp = tp
        self.config = engine_config(self.model_config, dtype, engine_options)
        check_tp(self.model_config, tp)
        check_overlap(self.config, tp)
        validate_checkpoint(self.folder)
        screen_checkpoint(self.folder, self.model_config.quantization)
        self.placement = choose_placement(device, tp, oversubscribe)
        self.tokenizer = _load_tokenizer(self.folder)
        # Fast tokenizers refuse concurrent use from several threads ("Already borrowed").
        self._tokenizer_lock = threading.Lock()
        self._core: EngineCore | None = None
        self._group: RankGroup | None = None
        if tp == 1 and in_process is not False:
            self._core = EngineCore(self.folder, self.model_config, self.config,
                                    self.placement.device_for(0))
        else:
            self._group = RankGroup(tp, self.placement, timeout=timeout)
            self._group.start()
            try:
                self._group.run(_start_core, self.folder, self.model_config, self.config)
            except BaseException:
                self._group.close(force=True)
                raise
        self._driver = Driver(self._advance, self._reset)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.shutdown(force=exc_type is not None)

    def shutdown(self, force: bool = False) -> None:
        """Fail the calls in flight with LLMClosed, stop the rank processes (if any) and drop
        the model; `force` kills the ranks at once. Calls afterwards raise LLMClosed."""
        # Unforced, the driver finishes the steps it is running before the ranks are asked
        # to stop. Forced (an exception, a signal), the ranks are killed first, hung ones
        # included, so that the driver's round trip ends with their deaths; only then is the
        # group closed: closing it while the driver is inside `run` would close the pipes
        # under the driver's feet, twice.
        self._driver.close(wait=not force)
        if force and self._group is not None:
            _kill_ranks(self._group)
        self._driver.join()
        if self._group is not None:
            self._group.close(force=force)
            self._group = None
        self._core = None

    def generate(self, prompts: str | Sequence[int] | torch.Tensor | Sequence[Any],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """One result per prompt. A prompt is a string (when the checkpoint has a tokenizer),
        a list of token ids or a 1-D integer tensor; `prompts` is one prompt, a list of them,
        or a 2-D tensor of one prompt per row. Unseeded sampling starts from the prompt's
        index in this call, so results do not depend on what other threads submit."""
        ids = [self._encode(p, i) for i, p in enumerate(split_prompts(prompts))]
        params = params or SamplingParams()
        per_prompt = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        # Checked here, not on the ranks: a request that fails there ends the rank group.
        check_request(ids, per_prompt, self.limits)
        results = self._driver.submit([Request(i, p, sp, default_seed(sp, i))
                                       for i, (p, sp) in enumerate(zip(ids, per_prompt))])
        if self.tokenizer is not None:
            with self._tokenizer_lock:
                for r in results:
                    r.text = self.tokenizer.decode(r.token_ids)
        return results

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any) -> list:
        """`fn(core, *args)` on every rank's EngineCore; per-rank results in rank order. Waits
        until no `generate` call is in flight, and holds new ones back until it returns."""
        with self._driver.exclusive():
            return self._run(fn, args)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt + new tokens) one request may have."""
        return min(self.config.max_model_len, self.model_config.max_position_embeddings)

    @property
    def limits(self) -> Limits:
        """What one request may be: ids in the vocabulary, within `max_len` and the cache."""
        return _limits(self.config, self.model_config)

    def _run(self, fn: Callable[..., Any], args: tuple) -> list:
        if self._core is not None:
            return [fn(self._core, *args)]
        if self._group is None:
            raise LLMClosed("LLM closed: shutdown() was called or its with block ended; "
                            "create a new LLM")
        if not self._group.running:
            raise RuntimeError("the rank group stopped after a rank failed (see the error "
                               "raised then); create a new LLM")
        return self._group.run(_on_core, fn, args)

    def _advance(self, new: list[Request]) -> list[tuple[int, GenerationResult]]:
        # In process a step costs no round trip: back to the queue after every one. Ranks
        # run a few steps per round trip through their pipes.
        steps = 1 if self._core is not None else STEPS_PER_CALL
        return self._run(_advance, (new, steps))[0]

    def _reset(self) -> None:
        if self._core is not None:
            self._core.reset()

    def _encode(self, prompt: Any, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.folder} has no tokenizer: pass token id lists")
            with self._tokenizer_lock:
                return self.tokenizer.encode(prompt)
        return token_ids(prompt, index)


def check_generate(model: str | Path, prompts: Any, params: SamplingParams, tp: int = 1,
                   dtype: str = "auto", timeout: float = DEFAULT_TIMEOUT,
                   **engine_options: Any) -> None:
    """The checks `LLM(model, tp, ...).generate(prompts, params)` makes in the parent, made
    before any rank starts or any weight loads (a 35B checkpoint takes minutes): ValueError
    naming the option, the TP size or the prompt (ids outside the vocabulary, too long)."""
    folder = resolve_model(model)
    model_config = load_config(folder)
    check_launch(tp, False, timeout)
    config = engine_config(model_config, dtype, engine_options)
    check_tp(model_config, tp)
    check_overlap(config, tp)
    prompts = split_prompts(prompts)
    tokenizer = _load_tokenizer(folder) if any(isinstance(p, str) for p in prompts) else None
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and tokenizer is None:
            raise ValueError(f"{folder} has no tokenizer: pass token id lists")
        ids.append(tokenizer.encode(prompt) if isinstance(prompt, str) else token_ids(prompt, i))
    check_request(ids, [params] * len(ids), _limits(config, model_config))


def _limits(cfg: EngineConfig, model_config: ModelConfig) -> Limits:
    blocks = cfg.num_kv_blocks or cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
    max_len = min(cfg.max_model_len, model_config.max_position_embeddings)
    return Limits(model_config.vocab_size, max_len, blocks, cfg.block_size)


def _load_tokenizer(folder: Path):
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _kill_ranks(group: RankGroup) -> None:
    """SIGKILL every rank of `group` and nothing else: unlike `close`, safe while another
    thread waits in `group.run` (it sees the deaths and returns)."""
    for proc in list(group._procs):
        if proc.is_alive():
            proc.kill()


def _start_core(ctx: RankContext, folder: Path, model_config: ModelConfig,
                config: EngineConfig) -> None:
    ctx.state["core"] = EngineCore(folder, model_config, config, ctx.device)


def _on_core(ctx: RankContext, fn: Callable[..., Any], args: tuple) -> Any:
    return fn(ctx.state["core"], *args)


def _advance(core: EngineCore, new: list[Request], max_steps: int):
    core.add_requests(new)
    finished = core.run_steps(max_steps)
    return finished if get_tp_info().is_first else None
