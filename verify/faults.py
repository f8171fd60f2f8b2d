"""Canonical TP bugs, injectable into the engine with `freetoken-verify --inject NAME`.

Each fault monkeypatches the engine inside the process that calls it (every rank, before
the checks run). They exist to show that the checks catch the bugs they are meant for: a
harness that stays green with a fault injected is broken."""

from __future__ import annotations

from collections.abc import Callable

import torch


def plain_chunk_gate_up() -> None:
    """Fill each merged gate|up weight with a plain row chunk of the packed `[gate; up]` instead
    of splitting gate and up separately: rank 0 of 2 gets all of gate, rank 1 all of up."""
    import freetoken.engine.core as core
    from freetoken.distributed import get_tp_info
    from freetoken.layers.linear import MergedColumnParallelLinear
    from freetoken.loading.specs import Split

    original = core.load_weights

    def load(model, reader, plan, progress=True):
        out = original(model, reader, plan, progress)
        tp = get_tp_info()
        for name, module in model.named_modules():
            if isinstance(module, MergedColumnParallelLinear) and name.endswith("gate_up_proj"):
                mlp = name.rsplit(".", 1)[0]
                packed = torch.cat([reader.get(f"{mlp}.gate_proj.weight"),
                                    reader.get(f"{mlp}.up_proj.weight")])
                module.weight.data.copy_(Split(0).shard(packed, tp.rank, tp.size))
        reader.close()
        return out

    core.load_weights = load


def drop_row_parallel_allreduce() -> None:
    """Row-parallel linears return their partial sums without the all-reduce."""
    from freetoken.layers.linear import RowParallelLinear

    RowParallelLinear.forward = lambda self, x: torch.nn.functional.linear(x, self.weight)


def kv_head_wrong_rank() -> None:
    """With fewer KV heads than ranks, each rank loads the KV head of the next rank over."""
    from freetoken.loading.specs import Heads

    def owner(self, rank, size):
        return (rank * self.num_heads // size + 1) % self.num_heads

    Heads._head_owner = owner


FAULTS: dict[str, Callable[[], None]] = {
    "plain-chunk-gate-up": plain_chunk_gate_up,
    "drop-allreduce": drop_row_parallel_allreduce,
    "kv-head-wrong-rank": kv_head_wrong_rank,
}


def inject(names: tuple[str, ...] | list[str]) -> None:
    """Apply the named faults in this process."""
    for name in names:
        FAULTS[name]()
