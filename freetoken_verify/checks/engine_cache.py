"""The per-rank engine cache the checks share: one EngineCore per rank, built once per model
and reused by every check that runs in the same rank group."""

from __future__ import annotations

import gc

from freetoken.config import EngineConfig
from freetoken.distributed import RankContext
from freetoken.engine.core import EngineCore
from freetoken.models.registry import load_config


def _key(engine_args: dict) -> tuple:
    return tuple(sorted(engine_args.items()))


def release_engine(rank_ctx: RankContext) -> None:
    """Drop the resident engine (and its memory) on this rank. The collection frees the
    engine's reference cycles; what survives it (modules, the rank's state) is frozen out of
    later collections, which otherwise walk every object torch and its compiler stack made at
    import (0.5-0.8 s per collection on the 2-core CI machine once torch._dynamo is loaded, a
    collection per engine build and per memory row: seconds per rank and TP size). Objects made
    after the freeze, the next engine among them, are collected as before."""
    rank_ctx.state.pop("engine", None)
    rank_ctx.state.pop("engine_key", None)
    gc.collect()
    gc.freeze()


def build_engine(rank_ctx: RankContext, engine_args: dict) -> EngineCore:
    """A freshly loaded engine for `engine_args`, made the rank's resident engine."""
    release_engine(rank_ctx)
    args = dict(engine_args)
    folder = args.pop("folder")
    # Parsed on the rank, as the launcher does in its process: the quantization-config faults
    # (`freetoken_verify.faults.quant_config`) patch that reading in the ranks only, so that
    # the parent's reading, which the checks compare with, stays right.
    model_config = load_config(folder)
    cfg = EngineConfig(progress=False, max_num_seqs=8, **args)
    rank_ctx.state["engine"] = EngineCore(folder, model_config, cfg, rank_ctx.device)
    rank_ctx.state["engine_key"] = _key(engine_args)
    return rank_ctx.state["engine"]


def resident_engine(rank_ctx: RankContext, engine_args: dict) -> EngineCore | None:
    """The rank's engine for `engine_args` if one is already loaded, else None."""
    if rank_ctx.state.get("engine_key") == _key(engine_args):
        return rank_ctx.state["engine"]
    return None


def resident_model(rank_ctx: RankContext):
    """The model of the rank's resident engine (whatever its arguments), or None."""
    engine = rank_ctx.state.get("engine")
    return None if engine is None else engine.model


def engine_on_rank(rank_ctx: RankContext, engine_args: dict) -> EngineCore:
    """This rank's engine for `engine_args` (see `Case.engine_args`), loaded on first use; a
    different model replaces the previous one so at most one is resident."""
    return resident_engine(rank_ctx, engine_args) or build_engine(rank_ctx, engine_args)
