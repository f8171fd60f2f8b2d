"""The engine as checks see it: one EngineCore per rank, built once per model and reused by
every check that runs in the same rank group."""

from __future__ import annotations

import gc

from freetoken.config import EngineConfig
from freetoken.distributed import RankContext
from freetoken.engine.core import EngineCore


def engine_on_rank(rank_ctx: RankContext, engine_args: dict) -> EngineCore:
    """This rank's engine for `engine_args` (see `Case.engine_args`); a different model
    replaces the previous one so at most one is resident."""
    key = tuple(sorted(engine_args.items()))
    if rank_ctx.state.get("engine_key") != key:
        rank_ctx.state.pop("engine", None)
        gc.collect()
        args = dict(engine_args)
        cfg = EngineConfig(args.pop("folder"), tp=rank_ctx.size, progress=False,
                           max_num_seqs=8, **args)
        rank_ctx.state["engine"] = EngineCore(cfg.model, cfg, rank_ctx.device)
        rank_ctx.state["engine_key"] = key
    return rank_ctx.state["engine"]
