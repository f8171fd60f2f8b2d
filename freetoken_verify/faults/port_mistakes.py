"""More canonical TP bugs (injectable like `freetoken_verify.faults`), each the one-line mistake a
TP port
makes in real source: a bias added on every rank, a sampler seeded per rank, a range check off
by one, a reduction forgotten in one layer family, a shard taken from the neighbour's slice.

`freetoken_verify.faults.FAULTS` registers them; `freetoken_verify.faults.catalogue.CATALOGUE` lists
every injectable bug with the bundled case and TP sizes where it bites."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import freetoken.engine.core as core
from freetoken.distributed import get_communicator, get_tp_info
from freetoken.engine.sampler import sample
from freetoken.formats.specs import Split
from freetoken.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from freetoken.layers.linear import RowParallelLinear
from freetoken.layers.moe import route
from freetoken.loading.plan import ShardPlan
from freetoken.models import registry
from freetoken.models.qwen3_5_moe import gdn
from freetoken.models.qwen3_5_moe.moe import SparseMoeBlock


def row_bias_before_allreduce() -> None:
    """Row-parallel linears add their bias to the partial sum on every rank, before the
    all-reduce: the bias is counted tp_size times."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return get_communicator().all_reduce(y) if self.reduce else y

    RowParallelLinear.forward = forward


def sample_per_rank() -> None:
    """Every rank samples its own token from a generator seeded with `seed + rank` instead of
    taking rank 0's broadcast: greedy decoding agrees, sampling at temperature > 0 does not."""

    def _sample(self, batch, logits):
        rank = get_tp_info().rank
        tokens = []
        for i, seq in enumerate(batch):
            if seq.generator is not None and not getattr(seq, "rank_seeded", False):
                seq.generator.manual_seed(seq.generator.initial_seed() + rank)
                seq.rank_seeded = True
            tokens.append(sample(logits[i], seq.params, seq.generator))
            if seq.params.return_logits:
                seq.step_logits.append(logits[i].cpu())
        return tokens

    core.EngineCore._sample = _sample


def gdn_value_dim_from_key_dim() -> None:
    """GatedDeltaNet sizes its value channels with the key head dim (`nv * dk`): invisible
    while key and value totals agree, a shape error naming the tensor when they do not."""

    original = gdn.GatedDeltaNet.__init__

    def init(self, cfg, *args, **kwargs):
        original(self, dataclasses.replace(cfg, linear_value_head_dim=cfg.linear_key_head_dim),
                 *args, **kwargs)

    gdn.GatedDeltaNet.__init__ = init


def embedding_range_inclusive() -> None:
    """The vocab-parallel embedding treats ids up to and including `start + local_vocab` as
    its own: the first id of the next rank's range is also looked up (clamped to this rank's
    last row) and added into the all-reduce."""

    def forward(self, ids):
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local <= self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        return get_communicator().all_reduce(out * inside.unsqueeze(-1).to(out.dtype))

    VocabParallelEmbedding.forward = forward


def embedding_missing_allreduce() -> None:
    """The vocab-parallel embedding returns its rank's rows without the all-reduce: each rank
    sees only the tokens in its vocab range."""

    def forward(self, ids):
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        return out * inside.unsqueeze(-1).to(out.dtype)

    VocabParallelEmbedding.forward = forward


def shared_expert_after_allreduce() -> None:
    """The Qwen3.5 MoE block all-reduces the routed experts only and adds the shared expert's
    rank-partial sum afterwards: each rank keeps only its own slice of the shared expert."""

    def forward(self, x):
        weights, ids = route(self.gate(x), self.top_k, True, x.dtype)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return get_communicator().all_reduce(self.experts(x, weights, ids)) + shared

    SparseMoeBlock.forward = forward


def lm_head_padding_kept() -> None:
    """The LM head gathers every rank's logits but forgets to slice off the vocab padding:
    logits are `padded_vocab` wide at TP sizes that pad."""

    def forward(self, hidden):
        weight = self.tied.weight if self.tied is not None else self.weight
        return get_communicator().all_gather(F.linear(hidden, weight), dim=-1)

    ParallelLMHead.forward = forward


def gdn_out_proj_unreduced() -> None:
    """GatedDeltaNet's out_proj is built without its all-reduce (as if the MoE block reduced
    it): one layer family misses its reduction."""

    original = gdn.GatedDeltaNet.__init__

    def init(self, cfg, *args, **kwargs):
        original(self, cfg, *args, **kwargs)
        self.out_proj.reduce = False

    gdn.GatedDeltaNet.__init__ = init


class _NextRank:
    """A shard spec that hands rank r the shard of rank r + 1 (an off-by-one rank index)."""

    def __init__(self, spec):
        self.spec = spec

    def shard(self, full, rank, size, name=""):
        return self.spec.shard(full, (rank + 1) % size, size, name)

    def pieces(self, full, rank, size, name=""):
        return self.spec.pieces(full, (rank + 1) % size, size, name)

    def unshard(self, parts, name=""):
        return self.spec.unshard(parts[-1:] + parts[:-1], name)


def _respec(arch: str, needle: str, make) -> None:
    """Replace the spec of every `arch` plan rule whose pattern contains `needle` by
    `make(spec)`, keeping destinations."""

    original = registry.ARCHITECTURES[arch].plan

    def plan(cfg, tp):
        rules = [dataclasses.replace(r, spec=make(r.spec)) if needle in r.pattern else r
                 for r in original(cfg, tp).rules]
        return ShardPlan(rules, tp)

    registry.ARCHITECTURES[arch] = dataclasses.replace(registry.ARCHITECTURES[arch], plan=plan)


def o_proj_next_rank() -> None:
    """Attention o_proj's input columns are taken from the next rank's slice (rank index off
    by one in a row-parallel split); the partial sums still add up to something fluent."""
    _respec("llama", "o_proj", _NextRank)


def expert_down_split_rows() -> None:
    """Qwen3-MoE expert down_proj split on its output rows (like gate/up) instead of its
    input columns: a shape error naming the tensor at load."""

    _respec("qwen3_moe", "down_proj", lambda spec: Split(0))


BUGS = {
    "row-bias-before-allreduce": row_bias_before_allreduce,
    "sample-per-rank": sample_per_rank,
    "gdn-value-dim-from-key-dim": gdn_value_dim_from_key_dim,
    "embedding-range-inclusive": embedding_range_inclusive,
    "embedding-missing-allreduce": embedding_missing_allreduce,
    "shared-expert-after-allreduce": shared_expert_after_allreduce,
    "lm-head-padding-kept": lm_head_padding_kept,
    "gdn-out-proj-unreduced": gdn_out_proj_unreduced,
    "o-proj-next-rank": o_proj_next_rank,
    "expert-down-split-rows": expert_down_split_rows,
}
