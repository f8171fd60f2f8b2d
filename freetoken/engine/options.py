"""`LLM(...)`'s options checked in the parent, each against what the ranks can take: a value a
rank cannot use (a zero block size, a layer count past the model's, an unknown dtype) would
otherwise fail only after every rank started and loaded the model. The engine's options
become its `EngineConfig`; the launcher's (TP size, placement, timeout) stay `LLM`'s own."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.core import DTYPE_ALIASES, DTYPES, canonical_dtype

_POSITIVE = ("block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens")
_OPTIONAL_POSITIVE = ("num_kv_blocks", "num_layers")
_FLAGS = ("progress", "enforce_eager")


def check_launch(tp: int, oversubscribe: bool, timeout: float) -> None:
    """ValueError naming the launcher option (TP size, oversubscribe, timeout) no rank group
    could start with."""
    _check_int("tp", tp)
    _check_flag("oversubscribe", oversubscribe)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds above 0, got {timeout!r}")


def engine_config(model_config: ModelConfig, dtype: str, options: dict[str, Any]
                  ) -> EngineConfig:
    """The EngineConfig of an `LLM(...)` call (its engine `options` and `dtype`); ValueError
    naming the option whose value (or name) no rank could take."""
    known = {f.name for f in fields(EngineConfig)} - {"dtype"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine option {unknown[0]!r}; expected one of "
                         f"{', '.join(sorted(known))}")
    dtype = canonical_dtype(dtype)
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)} (or "
                         f"{', '.join(DTYPE_ALIASES)}), got {dtype!r}")
    cfg = EngineConfig(dtype=dtype, **options)
    for name in _POSITIVE:
        _check_int(name, getattr(cfg, name))
    for name in _OPTIONAL_POSITIVE:
        if getattr(cfg, name) is not None:
            _check_int(name, getattr(cfg, name))
    for name in _FLAGS:
        _check_flag(name, getattr(cfg, name))
    if cfg.overlap_steps is not None:
        _check_flag("overlap_steps", cfg.overlap_steps)
    if cfg.num_layers is not None and cfg.num_layers > model_config.num_hidden_layers:
        raise ValueError(f"num_layers={cfg.num_layers} exceeds the model's "
                         f"num_hidden_layers={model_config.num_hidden_layers}")
    return cfg


def check_overlap(cfg: EngineConfig, tp: int) -> None:
    """ValueError when `overlap_steps=True` is asked at a TP size above 1: a rank group
    shares rank 0's tokens through the host, so a step cannot start before they are known."""
    if cfg.overlap_steps and tp > 1:
        raise ValueError(f"overlap_steps=True needs tp=1, got tp={tp} (the ranks share each "
                         "step's tokens through the host)")


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
