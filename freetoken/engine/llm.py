"""The public API: `LLM(model, tp=2).generate(prompts, SamplingParams(...))`.

TP=1 runs in this process; TP>1 starts one process per rank once and sends each generate call
to all of them (rank 0's results are returned)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from freetoken.config import EngineConfig
from freetoken.distributed import RankContext, RankGroup, choose_placement, get_tp_info
from freetoken.engine.core import EngineCore
from freetoken.engine.requests import check_request, token_ids
from freetoken.engine.resolve import resolve_model
from freetoken.engine.sequence import GenerationResult, SamplingParams
from freetoken.loading.screen import screen_checkpoint
from freetoken.loading.validate import validate_checkpoint
from freetoken.models.registry import check_tp, load_config


class LLM:
    """A loaded model at some TP size; use as a context manager or call `shutdown()`."""

    def __init__(self, model: str | Path, tp: int = 1, device: str = "auto",
                 dtype: str = "auto", oversubscribe: bool = False, in_process: bool | None = None,
                 **engine_options: Any):
        self.folder = resolve_model(model)
        self.model_config = load_config(self.folder)
        check_tp(self.model_config, tp)
        validate_checkpoint(self.folder)
        screen_checkpoint(self.folder, self.model_config.quantization)
        self.config = EngineConfig(str(self.folder), tp=tp, device=device, dtype=dtype,
                                   oversubscribe=oversubscribe, **engine_options)
        self.placement = choose_placement(device, tp, oversubscribe)
        self.tokenizer = _load_tokenizer(self.folder)
        self._core: EngineCore | None = None
        self._group: RankGroup | None = None
        if tp == 1 and in_process is not False:
            self._core = EngineCore(self.folder, self.config, self.placement.device_for(0))
        else:
            self._group = RankGroup(tp, self.placement, timeout=self.config.timeout)
            self._group.start()
            try:
                self._group.run(_start_core, self.folder, self.config)
            except BaseException:
                self._group.close(force=True)
                raise

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.shutdown(force=exc_type is not None)

    def shutdown(self, force: bool = False) -> None:
        """Stop the rank processes (if any) and drop the model; `force` kills them at once."""
        if self._group is not None:
            self._group.close(force=force)
            self._group = None
        self._core = None

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """One result per prompt. Prompts are token-id lists, or strings when the checkpoint
        has a tokenizer."""
        single = prompts and not isinstance(prompts[0], (str, list, tuple))
        if isinstance(prompts, str) or single:  # one prompt: a string or a list of ids
            prompts = [prompts]
        ids = [self._encode(p, i) for i, p in enumerate(prompts)]
        params = params or SamplingParams()
        per_prompt = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        # Checked here, not on the ranks: a request that fails there ends the rank group.
        check_request(ids, per_prompt, self.model_config.vocab_size, self.max_len)
        results = self.run_on_ranks(_generate, ids, per_prompt)[0]
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids)
        return results

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any) -> list:
        """`fn(core, *args)` on every rank's EngineCore; per-rank results in rank order."""
        if self._core is not None:
            return [fn(self._core, *args)]
        if self._group is None:
            raise RuntimeError("LLM was shut down")
        if not self._group.running:
            raise RuntimeError("the rank group stopped after a rank failed (see the error "
                               "raised then); create a new LLM")
        return self._group.run(_on_core, fn, args)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt + new tokens) one request may have."""
        return min(self.config.max_model_len, self.model_config.max_position_embeddings)

    def _encode(self, prompt: str | Sequence[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.folder} has no tokenizer: pass token id lists")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt {index}: a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        return token_ids(prompt, index)


def _load_tokenizer(folder: Path):
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _start_core(ctx: RankContext, folder: Path, config: EngineConfig) -> None:
    ctx.state["core"] = EngineCore(folder, config, ctx.device)


def _on_core(ctx: RankContext, fn: Callable[..., Any], args: tuple) -> Any:
    return fn(ctx.state["core"], *args)


def _generate(core: EngineCore, prompts, params):
    results = core.generate(prompts, params)
    return results if get_tp_info().is_first else None
