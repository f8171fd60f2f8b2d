"""Wrong-layout TP bugs in the scales of quantized checkpoints, for `--fault` (registered in
`freetoken_verify.faults.FAULTS`): the bugs other engines shipped when loading block-FP8,
per-tensor FP8 and NVFP4 checkpoints (vLLM #38517, #52915), each applied by replacing the
engine's own shard rule or spec in the process, shapes intact."""

from __future__ import annotations

import dataclasses

import torch

from freetoken.formats.fp8.interleaved import InterleavedBlockRows
from freetoken.formats.fp8.specs import BlockScaleSplit
from freetoken.formats.fp8.tensor import ScalarScale
from freetoken.formats.shard import Piece, ShardPieces
from freetoken.loading.plan import Rule
from freetoken_verify.faults._patch import after_load, rewrite_plans
from freetoken_verify.faults.registry import Entry, fault


def _pieces(shard: torch.Tensor, dim: int) -> ShardPieces:
    """A faulty shard as the one piece the loader copies (so it loads what `shard` says)."""
    return ShardPieces(tuple(shard.shape), (Piece(shard, dim, 0, shard.shape[dim]),))


@fault("fp8-scale-first-segment",
       Entry("a fused destination's per-tensor FP8 scales all written into its first segment",
             "tiny-qwen3.5-moe-mixed", (1, 2), ("memory", "shards"), r"weight_scale",
             tp1_green=False))
def fp8_scale_first_segment() -> None:
    """Every per-tensor FP8 `weight_scale` of a fused destination written into its first
    segment's entry (vLLM #38517: a tuple shard id filled slot 0 only): k's and v's scales
    land on q's entry, z's on in_proj_qkv's, up's on gate's."""

    def first_slot(rule: Rule) -> Rule:
        if isinstance(rule.spec, ScalarScale) and rule.pattern.endswith("weight_scale") \
                and rule.slot:
            return dataclasses.replace(rule, slot=(0,))
        return rule

    rewrite_plans(first_slot)


@fault("block-scale-rank-offset",
       Entry("block-scale rows of a rank taken at rank x rows instead of its first block",
             "tiny-qwen3.5-moe-fp8", (8,), ("memory", "shards"), r"weight_scale_inv"))
def block_scale_rank_offset() -> None:
    """A block-FP8 scale split takes rank r's first scale row (column) as r x the blocks per
    rank instead of the block holding the rank's first weight element: right while every
    rank's slice is whole blocks, wrong once slices are smaller than a block or start inside
    one (Qwen3.5-35B experts at TP 8, vLLM #52915), kept inside the grid."""

    original = BlockScaleSplit._span

    def span(self, rank, size, name):
        first, count = original(self, rank, size, name)
        start, step = self._chunk(rank, size, name)
        per_rank = max(original(self, r, size, name)[1] for r in range(size))
        wrong = self.start // self.block + (start - self.start) // step * per_rank
        return min(wrong, self.grid() - count), count

    BlockScaleSplit._span = span


@fault("block-scale-shared-neighbour",
       Entry("a rank sharing a scale block with its neighbour reads the next block",
             "tiny-qwen3.5-moe-fp8", (8,), ("memory", "shards"), r"weight_scale_inv"))
def block_scale_shared_neighbour() -> None:
    """A rank whose slice starts inside a scale block it shares with the previous rank (not
    the first rank of a segment that starts mid-block) reads the next block in its place (an
    off-by-one on the shared block), its other entries shifted after it, past the grid
    zeros."""

    original = BlockScaleSplit.shard

    def shard(self, full, rank, size, name=""):
        out = original(self, full, rank, size, name)
        if self.offset(rank, size, name) == 0 or self._chunk(rank, size, name)[0] == self.start:
            return out
        first = self._span(rank, size, name)[0] + 1
        have = min(out.shape[self.dim], full.shape[self.dim] - first)
        out.zero_()
        out.narrow(self.dim, 0, have).copy_(full.narrow(self.dim, first, have))
        return out

    BlockScaleSplit.shard = shard
    BlockScaleSplit.pieces = lambda self, full, rank, size, name="": _pieces(
        shard(self, full, rank, size, name), self.dim)


@fault("q-gate-scale-rows-unmoved",
       Entry("q|gate block-scale rows not moved with their head", "tiny-qwen3.5-moe-fp8", (1, 2),
             ("memory", "shards"), r"q_proj\.weight_scale_inv", tp1_green=False))
def q_gate_scale_rows_unmoved() -> None:
    """Qwen3.5's q_proj block scale, expanded to one row per weight row, cut as a plain row
    chunk while the weight's rows are regrouped `[q of the rank's heads | their gates]`: the
    scale rows do not move with their head (wrong at TP 1 too)."""

    def shard(self, full, rank, size, name=""):
        expanded = full.repeat_interleave(self.block, 0)[:self.rows]
        step = self.rows // size
        return expanded[rank * step:(rank + 1) * step].clone()

    InterleavedBlockRows.shard = shard
    InterleavedBlockRows.pieces = lambda self, full, rank, size, name="": _pieces(
        shard(self, full, rank, size, name), 0)


@fault("nvfp4-global-first-segment",
       Entry("one segment's NVFP4 global scale loaded for every segment",
             "tiny-qwen3.5-moe-nvfp4-ct", (1, 2), ("memory", "shards"), r"weight_global_scale",
             tp1_green=False))
def nvfp4_global_first_segment() -> None:
    """The loader gives every segment of a fused NVFP4 linear the first segment's global
    scale (q's for q, k and v; gate's for up): right only when the producer made them equal."""

    def patch(model, reader, plan):
        for module in model.modules():
            globals_ = getattr(module, "weight_scale_2", None)
            if isinstance(globals_, torch.nn.Parameter) and globals_.numel() > 1:
                globals_.data.copy_(globals_.data[:1].expand_as(globals_))

    after_load(patch)
