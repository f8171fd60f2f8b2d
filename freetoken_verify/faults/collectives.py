"""Collective faults: a reduction doubled, added or missing in one place, and a Communicator
that reduces a contiguous copy of a strided input. The `collectives` check exists to catch
them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from freetoken.distributed import get_communicator
from freetoken.distributed.comm import Communicator
from freetoken.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from freetoken.layers.moe import route
from freetoken.models.qwen3_5_moe.moe import SparseMoeBlock
from freetoken_verify.faults.registry import Entry, fault


@fault("moe-reduce-separately",
       Entry("MoE routed and shared reduced separately", "tiny-qwen3.5-moe", (2,), ("collectives",),
             r"model\.layers\.0\.mlp: .*doubled"))
def moe_reduce_routed_and_shared_separately() -> None:
    """The Qwen3.5-MoE block all-reduces the routed experts' partial sum and the shared
    expert's separately, then adds them: the same numbers for twice the communication."""

    def forward(self, x):
        weights, ids = route(self.gate(x), self.top_k, True, x.dtype)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        comm = get_communicator()
        return comm.all_reduce(self.experts(x, weights, ids)) + comm.all_reduce(shared)

    SparseMoeBlock.forward = forward


@fault("embedding-extra-allreduce",
       Entry("embedding reduced twice", "tiny-llama", (2,), ("collectives",),
             r"model\.embed_tokens: .*doubled"))
def embedding_extra_allreduce() -> None:
    """The vocab-parallel embedding all-reduces its already reduced output once more: every
    embedding row comes out tp_size times too large."""

    original = VocabParallelEmbedding.forward
    VocabParallelEmbedding.forward = lambda self, ids: get_communicator().all_reduce(
        original(self, ids))


@fault("lm-head-no-gather",
       Entry("LM head gather missing", "tiny-qwen3", (2,), ("collectives",), r"lm_head: .*missing"))
def lm_head_no_gather() -> None:
    """The LM head returns each rank's own vocab-shard logits without gathering them."""

    def forward(self, hidden):
        weight = self.tied.weight if self.tied is not None else self.weight
        return torch.nn.functional.linear(hidden, weight)[..., : self.vocab_size]

    ParallelLMHead.forward = forward


@fault("allreduce-contiguous-copy",
       Entry("all-reduce on a contiguous copy", "tiny-llama", (2,), ("collectives",),
             r"Communicator\.all_reduce on a"))
def allreduce_contiguous_copy() -> None:
    """Communicator.all_reduce reduces `x.contiguous()` and returns `x`: a non-contiguous
    input is reduced in a copy that is thrown away and comes back unreduced."""

    def all_reduce(self, x):
        if self.size > 1:
            dist.all_reduce(x.contiguous())
        return x

    Communicator.all_reduce = all_reduce
