"""Wrong-layout TP bugs for `--fault` (registered in `freetoken_verify.faults.FAULTS`): rows of a
packed or per-head tensor put in the wrong slot by the plan or the loader, shapes intact."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import freetoken.engine.core as core
from freetoken.distributed import get_tp_info
from freetoken.formats.nvfp4 import specs
from freetoken.formats.specs import Split
from freetoken.loading.plan import ShardPlan
from freetoken.models import registry
from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet


@dataclass(frozen=True)
class _FirstChunk:
    """A split that hands every rank the first 1/tp of the rows (rank 0's chunk)."""

    def shard(self, full, rank, size, name=""):
        return full[: full.shape[0] // size].clone()

    def unshard(self, parts, name=""):
        return torch.cat(parts)


def _replace_rule_specs(arch: str, needles: tuple[str, ...], spec) -> None:
    """Give every `arch` plan rule whose pattern contains one of `needles` the shard spec
    `spec`, keeping destinations as they are."""

    original = registry.ARCHITECTURES[arch].plan

    def plan(cfg, tp):
        rules = [dataclasses.replace(r, spec=spec) if any(n in r.pattern for n in needles)
                 else r for r in original(cfg, tp).rules]
        return ShardPlan(rules, tp)

    registry.ARCHITECTURES[arch] = dataclasses.replace(registry.ARCHITECTURES[arch], plan=plan)


def gdn_heads_from_first() -> None:
    """GatedDeltaNet A_log and dt_bias take the first value heads on every rank (rank r
    should hold heads [r * nv / tp, (r + 1) * nv / tp))."""
    _replace_rule_specs("qwen3_5_moe", ("A_log",), _FirstChunk())


def _checkpoint_name(names: list[str], suffix: str) -> str:
    """The checkpoint name ending in `suffix` (`layers.0.linear_attn.in_proj_z.weight`),
    whatever prefix the checkpoint puts before `layers`."""
    return next(n for n in names if n.endswith("." + suffix) or n == suffix)


def _after_load(patch: Callable) -> None:
    """Run `patch(model, reader, tp)` after the engine's own loading, as a loader with the
    bug would leave the parameters."""

    original = core.load_weights

    def load(model, reader, plan, progress=True):
        out = original(model, reader, plan, progress)
        patch(model, reader, get_tp_info())
        reader.close()
        return out

    core.load_weights = load


def plain_chunk_gdn_zba() -> None:
    """GatedDeltaNet in_proj_z, in_proj_b and in_proj_a loaded as one packed `[z | b | a]`
    cut in plain row chunks: each rank's z slot gets z rows, but its b and a slots get more
    z rows instead of the b and a of its value heads."""

    def patch(model, reader, tp):
        names = reader.names()
        for name, module in model.named_modules():
            if not isinstance(module, GatedDeltaNet):
                continue
            layer = name.split(".")[2]
            packed = torch.cat([reader.get(_checkpoint_name(
                names, f"layers.{layer}.linear_attn.in_proj_{x}.weight")) for x in "zba"])
            chunk = Split(0).shard(packed, tp.rank, tp.size)
            module.in_proj.weight.data[-chunk.shape[0]:].copy_(chunk)

    _after_load(patch)


def plain_chunk_shared_gate_up() -> None:
    """The shared expert's merged gate|up weight filled with a plain row chunk of the packed
    `[gate; up]`: at TP 2 rank 0 gets all of gate, rank 1 all of up."""

    def patch(model, reader, tp):
        names = reader.names()
        for name, module in model.named_modules():
            if not name.endswith("mlp.shared_expert"):
                continue
            layer = name.split(".")[2]
            packed = torch.cat([reader.get(_checkpoint_name(
                names, f"layers.{layer}.mlp.shared_expert.{x}_proj.weight"))
                for x in ("gate", "up")])
            module.gate_up_proj.weight.data.copy_(Split(0).shard(packed, tp.rank, tp.size))

    _after_load(patch)


def nvfp4_scale_group_shifted() -> None:
    """NVFP4 block scales of a split input dimension start one 16-input group late on every
    rank after the first (a fencepost in the group offset), wrapping around: the scales no
    longer line up with the packed inputs they scale."""

    original = specs.InputSplit.shard

    def shard(self, full, rank, size, name=""):
        out = original(self, full, rank, size, name)
        if self.kind != specs.SCALE or rank == 0:
            return out
        step = out.shape[self.dim]
        columns = (torch.arange(step) + rank * step + rank) % full.shape[self.dim]
        return full.index_select(self.dim, columns).contiguous()

    specs.InputSplit.shard = shard
