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


def _view_chunk(full, dim, rank, size, name):
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


def shard_views() -> None:
    """Shard functions return `narrow()` views of the checkpoint tensor instead of copies."""
    from freetoken.loading import specs

    specs._chunk = _view_chunk
    specs.Replicate.shard = lambda self, full, rank, size, name="": full


def split_replicated() -> None:
    """Tensors meant to be replicated (norms, routers) are split across ranks instead."""
    from freetoken.loading import specs

    specs.Replicate.shard = lambda self, full, rank, size, name="": _view_chunk(
        full, 0, rank, size, name).clone()
    specs.Replicate.unshard = lambda self, parts, name="": torch.cat(parts)


def vocab_pad_dropped() -> None:
    """Vocab-parallel rows are cut in ceil(vocab / tp) chunks without padding, so the last
    rank gets a short shard."""
    from freetoken.loading import specs

    def shard(self, full, rank, size, name=""):
        step = -(-self.full_size // size)
        return full[rank * step : (rank + 1) * step].clone()

    specs.PaddedSplit.shard = shard


def pin_checkpoint_views() -> None:
    """After loading, whole-tensor parameters are re-pointed at views of the checkpoint
    tensors (a loader that keeps `narrow()` results): each pins its full parent tensor."""
    import freetoken.engine.core as core
    from freetoken.distributed import get_tp_info

    original = core.load_weights

    def load(model, reader, plan, progress=True):
        out = original(model, reader, plan, progress)
        params, tp = dict(model.named_parameters()), get_tp_info()
        for name in reader.names():
            target = plan.resolve(name)
            if target.param in params and not target.slot:
                full = reader.get(name).to(params[target.param].dtype)
                dim = 1 if target.param.endswith(("o_proj.weight", "down_proj.weight")) else 0
                params[target.param].data = _view_chunk(full, dim, tp.rank, tp.size, name) \
                    if params[target.param].shape != full.shape else full
        reader.close()
        return out

    core.load_weights = load


FAULTS: dict[str, Callable[[], None]] = {
    "plain-chunk-gate-up": plain_chunk_gate_up,
    "drop-allreduce": drop_row_parallel_allreduce,
    "kv-head-wrong-rank": kv_head_wrong_rank,
    "shard-views": shard_views,
    "split-replicated": split_replicated,
    "vocab-pad-dropped": vocab_pad_dropped,
    "pin-checkpoint-views": pin_checkpoint_views,
}


def inject(names: tuple[str, ...] | list[str]) -> None:
    """Apply the named faults in this process."""
    for name in names:
        FAULTS[name]()
