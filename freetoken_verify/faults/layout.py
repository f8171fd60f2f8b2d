"""Wrong-layout TP bugs for `--fault` (registered in `freetoken_verify.faults.FAULTS`): rows of a
packed or per-head tensor put in the wrong slot by the plan or the loader, shapes intact."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.distributed import get_tp_info
from freetoken.formats.nvfp4 import specs
from freetoken.formats.specs import Split
from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet
from freetoken_verify.faults._patch import after_load, checkpoint_name, respec
from freetoken_verify.faults.registry import Entry, fault


@dataclass(frozen=True)
class _FirstChunk:
    """A split that hands every rank the first 1/tp of the rows (rank 0's chunk)."""

    def shard(self, full, rank, size, name=""):
        return full[: full.shape[0] // size].clone()

    def unshard(self, parts, name=""):
        return torch.cat(parts)


@fault("gdn-heads-from-first",
       Entry("A_log / dt_bias from the first value heads", "tiny-qwen3.5-moe", (2,), ("shards",),
             r"linear_attn\.A_log rank 1"))
def gdn_heads_from_first() -> None:
    """GatedDeltaNet A_log and dt_bias take the first value heads on every rank (rank r
    should hold heads [r * nv / tp, (r + 1) * nv / tp))."""
    respec("qwen3_5_moe", ("A_log",), lambda spec: _FirstChunk())


@fault("plain-chunk-gdn-zba",
       Entry("GDN z|b|a packed and cut in plain chunks", "tiny-qwen3.5-moe", (2,),
             ("golden", "shards"), r"in_proj_[zba]\.weight rank"))
def plain_chunk_gdn_zba() -> None:
    """GatedDeltaNet in_proj_z, in_proj_b and in_proj_a loaded as one packed `[z | b | a]`
    cut in plain row chunks: each rank's z slot gets z rows, but its b and a slots get more
    z rows instead of the b and a of its value heads."""

    def patch(model, reader, plan):
        tp, names = get_tp_info(), reader.names()
        for name, module in model.named_modules():
            if not isinstance(module, GatedDeltaNet):
                continue
            layer = name.split(".")[2]
            packed = torch.cat([reader.get(checkpoint_name(
                names, f"layers.{layer}.linear_attn.in_proj_{x}.weight")) for x in "zba"])
            chunk = Split(0).shard(packed, tp.rank, tp.size)
            module.in_proj.weight.data[-chunk.shape[0]:].copy_(chunk)

    after_load(patch)


@fault("plain-chunk-shared-gate-up",
       Entry("shared-expert gate|up split as one plain chunk", "tiny-qwen3.5-moe", (2,),
             ("golden", "shards"), r"shared_expert"))
def plain_chunk_shared_gate_up() -> None:
    """The shared expert's merged gate|up weight filled with a plain row chunk of the packed
    `[gate; up]`: at TP 2 rank 0 gets all of gate, rank 1 all of up."""

    def patch(model, reader, plan):
        tp, names = get_tp_info(), reader.names()
        for name, module in model.named_modules():
            if not name.endswith("mlp.shared_expert"):
                continue
            layer = name.split(".")[2]
            packed = torch.cat([reader.get(checkpoint_name(
                names, f"layers.{layer}.mlp.shared_expert.{x}_proj.weight"))
                for x in ("gate", "up")])
            module.gate_up_proj.weight.data.copy_(Split(0).shard(packed, tp.rank, tp.size))

    after_load(patch)


@fault("block-scale-group-shifted",
       Entry("NVFP4 block scales split off their 16-input group", "tiny-qwen3.5-moe-nvfp4", (2,),
             ("shards",), r"weight_scale rank 1"))
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
