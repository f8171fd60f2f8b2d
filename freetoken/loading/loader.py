"""Strict loading: every checkpoint tensor is consumed by exactly one rule, every parameter
element is written exactly once, shapes and dtypes are checked."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from tqdm import tqdm

from freetoken.distributed import get_tp_info
from freetoken.loading.checkpoint import CheckpointReader
from freetoken.loading.finite import check_finite
from freetoken.loading.plan import ShardPlan, slot_key


class LoadError(ValueError):
    """A checkpoint does not fit the model it is loaded into."""


def load_weights(model: nn.Module, reader: CheckpointReader, plan: ShardPlan,
                 progress: bool = True) -> dict[str, int]:
    """Fill `model`'s parameters with this rank's shards; returns bytes read per tensor kind.

    Rank-dependent: each rank writes its own shard of every tensor.
    """
    tp = get_tp_info()
    params = dict(model.named_parameters())
    filled: dict[str, dict[str, int]] = defaultdict(dict)
    names = reader.names()
    bar = tqdm(names, desc="loading", unit="tensor", disable=not (progress and tp.is_first),
               leave=False)
    for name in bar:
        target = plan.resolve(name)
        if target.param is None:
            continue
        if target.param not in params:
            raise LoadError(f"checkpoint tensor {name!r} maps to parameter {target.param!r}, "
                            "which the model does not have")
        shard = target.rule.spec.shard(reader.get(name), tp.rank, tp.size, name)
        dest = params[target.param].data[target.slot] if target.slot else params[target.param].data
        _check_fit(name, shard, dest, target.param)
        key = slot_key(target.slot)
        if key in filled[target.param]:
            raise LoadError(f"parameter {target.param!r} slot {key} written twice "
                            f"(second time by {name!r})")
        dest.copy_(shard)
        check_finite(name, dest)
        filled[target.param][key] = dest.numel()
    _check_complete(params, filled)
    reader.close()
    return {p: sum(v.values()) for p, v in filled.items()}


def _check_fit(name: str, shard: torch.Tensor, dest: torch.Tensor, param: str) -> None:
    if tuple(shard.shape) != tuple(dest.shape):
        raise LoadError(f"checkpoint tensor {name!r}: shard shape {tuple(shard.shape)} does not "
                        f"fit parameter {param!r} slot of shape {tuple(dest.shape)}")
    if shard.dtype.is_floating_point != dest.dtype.is_floating_point:
        raise LoadError(f"checkpoint tensor {name!r}: dtype {shard.dtype} cannot fill "
                        f"parameter {param!r} of dtype {dest.dtype}")


def _check_complete(params: dict, filled: dict) -> None:
    missing = [n for n, p in params.items() if sum(filled.get(n, {}).values()) != p.numel()]
    if missing:
        shown = ", ".join(
            f"{n} ({sum(filled.get(n, {}).values())}/{params[n].numel()} elements)"
            for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"parameters not filled by the checkpoint: {shown}{more}")
