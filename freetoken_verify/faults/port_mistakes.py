"""More canonical TP bugs (injectable like `freetoken_verify.faults`), each the one-line mistake a
TP port makes in real source: a bias added on every rank, a sampler seeded per rank, a range
check off by one, a reduction forgotten in one layer family, a shard taken from the
neighbour's slice. Each is registered with its catalogue entry (the bundled case and TP sizes
where it bites) beside it."""

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
from freetoken.models.qwen3_5_moe import gdn
from freetoken.models.qwen3_5_moe.moe import SparseMoeBlock
from freetoken_verify.faults._patch import respec
from freetoken_verify.faults.registry import Entry, fault


@fault("row-bias-before-allreduce",
       Entry("row-parallel bias added on every rank", "tiny-llama", (2,), ("golden",),
             r"first divergence: prefill/model\.layers\.0\.self_attn\.o_proj"))
def row_bias_before_allreduce() -> None:
    """Row-parallel linears add their bias to the partial sum on every rank, before the
    all-reduce: the bias is counted tp_size times."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return get_communicator().all_reduce(y) if self.reduce else y

    RowParallelLinear.forward = forward


@fault("sample-per-rank",
       Entry("ranks sample independently", "tiny-qwen3", (2,), ("golden",), r"rank 1 produced"))
def sample_per_rank() -> None:
    """Every rank samples its own token from a generator seeded with `seed + rank` instead of
    taking rank 0's broadcast: greedy decoding agrees, sampling at temperature > 0 does not."""

    def _sample(self, batch, logits, greedy=None):
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


@fault("gdn-value-dim-from-key-dim",
       Entry("GDN value dims sized from key dims", "tiny-qwen3.5-moe", (1, 2), ("golden",),
             r"linear_attn", tp1_green=False))
def gdn_value_dim_from_key_dim() -> None:
    """GatedDeltaNet sizes its value channels with the key head dim (`nv * dk`): invisible
    while key and value totals agree, a shape error naming the tensor when they do not."""

    original = gdn.GatedDeltaNet.__init__

    def init(self, cfg, *args, **kwargs):
        original(self, dataclasses.replace(cfg, linear_value_head_dim=cfg.linear_key_head_dim),
                 *args, **kwargs)

    gdn.GatedDeltaNet.__init__ = init


@fault("embedding-range-inclusive",
       Entry("vocab range check off by one", "tiny-qwen3", (2, 4), ("golden",),
             r"first divergence: prefill/model\.embed_tokens"))
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


@fault("embedding-missing-allreduce",
       Entry("embedding all-reduce missing", "tiny-llama", (2,), ("bisect",),
             r"model\.embed_tokens \(rank 1 holds a different"))
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


@fault("shared-expert-after-allreduce",
       Entry("shared expert added after the MoE all-reduce", "tiny-qwen3.5-moe", (2,), ("golden",),
             r"divergence: prefill/model\.layers\.0\.mlp "))
def shared_expert_after_allreduce() -> None:
    """The Qwen3.5 MoE block all-reduces the routed experts only and adds the shared expert's
    rank-partial sum afterwards: each rank keeps only its own slice of the shared expert."""

    def forward(self, x):
        weights, ids = route(self.gate(x), self.top_k, True, x.dtype)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return get_communicator().all_reduce(self.experts(x, weights, ids)) + shared

    SparseMoeBlock.forward = forward


@fault("lm-head-padding-kept",
       Entry("LM head keeps the vocab padding", "tiny-llama", (2,), ("bisect",), r"lm_head"))
def lm_head_padding_kept() -> None:
    """The LM head gathers every rank's logits but forgets to slice off the vocab padding:
    logits are `padded_vocab` wide at TP sizes that pad."""

    def forward(self, hidden):
        weight = self.tied.weight if self.tied is not None else self.weight
        return get_communicator().all_gather(F.linear(hidden, weight), dim=-1)

    ParallelLMHead.forward = forward


@fault("gdn-out-proj-unreduced",
       Entry("one layer family misses its all-reduce", "tiny-qwen3.5-moe", (2,), ("bisect",),
             r"linear_attn\.out_proj \(rank 1 holds a different"))
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


@fault("o-proj-next-rank",
       Entry("row-parallel input columns from the wrong rank", "tiny-llama", (2,), ("bisect",),
             r"self_attn\.o_proj"))
def o_proj_next_rank() -> None:
    """Attention o_proj's input columns are taken from the next rank's slice (rank index off
    by one in a row-parallel split); the partial sums still add up to something fluent."""
    respec("llama", ("o_proj",), _NextRank)


@fault("expert-down-split-rows",
       Entry("expert down_proj split on the wrong dim", "tiny-qwen3-moe", (2,), ("golden",),
             r"down_proj"))
def expert_down_split_rows() -> None:
    """Qwen3-MoE expert down_proj split on its output rows (like gate/up) instead of its
    input columns: a shape error naming the tensor at load."""

    respec("qwen3_moe", ("down_proj",), lambda spec: Split(0))
