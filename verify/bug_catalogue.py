"""More canonical TP bugs (injectable like `verify.faults`), each the one-line mistake a TP port
makes in real source: a bias added on every rank, a sampler seeded per rank, a range check off
by one, a reduction forgotten in one layer family, a shard taken from the neighbour's slice.

`verify.faults.FAULTS` registers them; `CATALOGUE` lists the injectable bugs with the bundled
case and TP sizes where it bites (the extra-copy faults `keep-shard-copies` and
`double-copy-load` need a checkpoint larger than the tiny cases and are proven on a generated
one in `tests/verify/test_memory_check.py`), the checks that must catch it and the words the
failing row must contain, and `tests/verify/test_catalogue.py` proves each entry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def row_bias_before_allreduce() -> None:
    """Row-parallel linears add their bias to the partial sum on every rank, before the
    all-reduce: the bias is counted tp_size times."""
    from freetoken.distributed import get_communicator
    from freetoken.layers.linear import RowParallelLinear

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return get_communicator().all_reduce(y) if self.reduce else y

    RowParallelLinear.forward = forward


def sample_per_rank() -> None:
    """Every rank samples its own token from a generator seeded with `seed + rank` instead of
    taking rank 0's broadcast: greedy decoding agrees, sampling at temperature > 0 does not."""
    import freetoken.engine.core as core
    from freetoken.distributed import get_tp_info
    from freetoken.engine.sampler import sample

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
    import dataclasses

    from freetoken.models.qwen3_5_moe import gdn

    original = gdn.GatedDeltaNet.__init__

    def init(self, cfg):
        original(self, dataclasses.replace(cfg, linear_value_head_dim=cfg.linear_key_head_dim))

    gdn.GatedDeltaNet.__init__ = init


def embedding_range_inclusive() -> None:
    """The vocab-parallel embedding treats ids up to and including `start + local_vocab` as
    its own: the first id of the next rank's range is also looked up (clamped to this rank's
    last row) and added into the all-reduce."""
    from freetoken.distributed import get_communicator, get_tp_info
    from freetoken.layers.embedding import VocabParallelEmbedding

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
    from freetoken.distributed import get_tp_info
    from freetoken.layers.embedding import VocabParallelEmbedding

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
    from freetoken.distributed import get_communicator
    from freetoken.layers.moe import route
    from freetoken.models.qwen3_5_moe.moe import SparseMoeBlock

    def forward(self, x):
        weights, ids = route(self.gate(x), self.top_k, True, x.dtype)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return get_communicator().all_reduce(self.experts(x, weights, ids)) + shared

    SparseMoeBlock.forward = forward


def lm_head_padding_kept() -> None:
    """The LM head gathers every rank's logits but forgets to slice off the vocab padding:
    logits are `padded_vocab` wide at TP sizes that pad."""
    from freetoken.distributed import get_communicator
    from freetoken.layers.embedding import ParallelLMHead

    def forward(self, hidden):
        weight = self.tied.weight if self.tied is not None else self.weight
        return get_communicator().all_gather(F.linear(hidden, weight), dim=-1)

    ParallelLMHead.forward = forward


def gdn_out_proj_unreduced() -> None:
    """GatedDeltaNet's out_proj is built without its all-reduce (as if the MoE block reduced
    it): one layer family misses its reduction."""
    from freetoken.models.qwen3_5_moe import gdn

    original = gdn.GatedDeltaNet.__init__

    def init(self, cfg):
        original(self, cfg)
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
    import dataclasses

    from freetoken.loading.plan import ShardPlan
    from freetoken.models import registry

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
    from freetoken.formats.specs import Split

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


@dataclass(frozen=True)
class Entry:
    """One TP bug class: inject `fault` into `model` and run `checks` at `tp` (TP=1 too when
    `tp1_green`) on `device`: every TP size in `tp` must fail a row whose message matches
    `words` (a regex naming the module, tensor or rank); at TP=1 every row must pass."""

    bug_class: str
    fault: str
    model: str
    tp: tuple[int, ...]
    checks: tuple[str, ...]
    words: str
    tp1_green: bool = True
    device: str = "cpu"


CATALOGUE: tuple[Entry, ...] = (
    Entry("row-parallel bias added on every rank", "row-bias-before-allreduce", "tiny-llama",
          (2,), ("golden",), r"first divergence: prefill/model\.layers\.0\.self_attn\.o_proj"),
    Entry("ranks sample independently", "sample-per-rank", "tiny-qwen3", (2,), ("golden",),
          r"rank 1 produced"),
    Entry("GDN value dims sized from key dims", "gdn-value-dim-from-key-dim", "tiny-qwen3.5-moe",
          (1, 2), ("golden",), r"linear_attn", tp1_green=False),
    Entry("vocab range check off by one", "embedding-range-inclusive", "tiny-qwen3", (2, 4),
          ("golden",), r"first divergence: prefill/model\.embed_tokens"),
    Entry("embedding all-reduce missing", "embedding-missing-allreduce", "tiny-llama", (2,),
          ("bisect",), r"model\.embed_tokens \(rank 1 holds a different"),
    Entry("shared expert added after the MoE all-reduce", "shared-expert-after-allreduce",
          "tiny-qwen3.5-moe", (2,), ("golden",), r"divergence: prefill/model\.layers\.0\.mlp "),
    Entry("LM head keeps the vocab padding", "lm-head-padding-kept", "tiny-llama", (2,),
          ("bisect",), r"lm_head"),
    Entry("one layer family misses its all-reduce", "gdn-out-proj-unreduced", "tiny-qwen3.5-moe",
          (2,), ("bisect",), r"linear_attn\.out_proj \(rank 1 holds a different"),
    Entry("row-parallel input columns from the wrong rank", "o-proj-next-rank", "tiny-llama",
          (2,), ("bisect",), r"self_attn\.o_proj"),
    Entry("expert down_proj split on the wrong dim", "expert-down-split-rows", "tiny-qwen3-moe",
          (2,), ("golden",), r"down_proj"),
    Entry("row-parallel all-reduce dropped", "drop-allreduce", "tiny-qwen3", (2,), ("bisect",),
          r"self_attn\.o_proj \(rank 1 holds a different"),
    Entry("MoE routed and shared reduced separately", "moe-reduce-separately",
          "tiny-qwen3.5-moe", (2,), ("collectives",), r"model\.layers\.0\.mlp: .*doubled"),
    Entry("embedding reduced twice", "embedding-extra-allreduce", "tiny-llama", (2,),
          ("collectives",), r"model\.embed_tokens: .*doubled"),
    Entry("LM head gather missing", "lm-head-no-gather", "tiny-qwen3", (2,), ("collectives",),
          r"lm_head: .*missing"),
    Entry("all-reduce on a contiguous copy", "allreduce-contiguous-copy", "tiny-llama", (2,),
          ("collectives",), r"Communicator\.all_reduce on a"),
    Entry("A_log / dt_bias from the first value heads", "gdn-heads-from-first",
          "tiny-qwen3.5-moe", (2,), ("shards",), r"linear_attn\.A_log rank 1"),
    Entry("GDN z|b|a packed and cut in plain chunks", "plain-chunk-gdn-zba", "tiny-qwen3.5-moe",
          (2,), ("golden", "shards"), r"in_proj_[zba]\.weight rank"),
    Entry("shared-expert gate|up split as one plain chunk", "plain-chunk-shared-gate-up",
          "tiny-qwen3.5-moe", (2,), ("golden", "shards"), r"shared_expert"),
    Entry("NVFP4 block scales split off their 16-input group", "block-scale-group-shifted",
          "tiny-qwen3.5-moe-nvfp4", (2,), ("shards",), r"weight_scale rank 1"),
    Entry("torch NVFP4 backend reads nibbles swapped", "torch-nvfp4-nibble-swap", "tiny-llama",
          (1,), ("kernels",), r"torch NVFP4 backend disagrees", tp1_green=False),
    Entry("torch NVFP4 backend drops the w13 global scale", "torch-nvfp4-drop-w13-global",
          "tiny-llama", (1,), ("kernels",), r"torch NVFP4 backend disagrees", tp1_green=False),
    Entry("dense gate|up split as one plain chunk", "plain-chunk-gate-up", "tiny-llama", (2,),
          ("golden",), r"first divergence: prefill/model\.layers\.0\.mlp\.gate_up_proj"),
    Entry("expert gate|up split as one plain chunk", "plain-chunk-expert-gate-up",
          "tiny-qwen3-moe", (2,), ("golden",), r"mlp\.experts"),
    Entry("KV head on the wrong rank", "kv-head-wrong-rank", "tiny-llama", (4,), ("golden",),
          r"self_attn\.qkv_proj"),
    Entry("GDN in_proj_qkv split as one plain chunk", "plain-chunk-gdn-qkv", "tiny-qwen3.5-moe",
          (2,), ("golden",), r"linear_attn\.in_proj"),
    Entry("GDN conv1d split as one plain chunk", "plain-chunk-gdn-conv1d", "tiny-qwen3.5-moe",
          (2,), ("golden",), r"linear_attn\.conv1d"),
    Entry("gated-attention q|gate split at the midpoint", "plain-chunk-q-gate", "tiny-qwen3.5-moe",
          (2,), ("golden",), r"self_attn\.qkv_proj", tp1_green=False),
    Entry("replicated tensors split", "split-replicated", "tiny-qwen3", (2,),
          ("golden", "shards"), r"layernorm|norm\.weight"),
    Entry("vocab padding dropped", "vocab-pad-dropped", "tiny-llama", (2, 4),
          ("golden", "shards"), r"embed_tokens|lm_head"),
    Entry("shards are views of the checkpoint", "shard-views", "tiny-llama", (1, 2),
          ("shards",), r"view", tp1_green=False),
    Entry("loader pins the checkpoint", "pin-checkpoint-views", "tiny-llama", (1, 2),
          ("memory",), r"pins", tp1_green=False),
    Entry("KV cache sized with the global KV heads", "kv-cache-global-heads", "tiny-llama",
          (2,), ("memory",), r"KV cache is \d+ bytes"),
    Entry("GatedDeltaNet state sized with the global value heads", "gdn-state-global-heads",
          "tiny-qwen3.5-moe", (2,), ("memory",), r"GatedDeltaNet recurrent state is \d+ bytes"),
    Entry("NVFP4 nibbles swapped", "nvfp4-nibble-swap", "tiny-llama", (1,), ("kernels",),
          r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 down global scale dropped", "nvfp4-drop-global-scale", "tiny-llama", (1,),
          ("kernels",), r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 gate/up global scales swapped", "nvfp4-gate-up-globals-swapped", "tiny-llama",
          (1,), ("kernels",), r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 intermediate size off by a group", "nvfp4-intermediate-off-by-group",
          "tiny-llama", (1,), ("kernels",), r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 gate/up global scales swapped at load", "nvfp4-load-globals-swapped",
          "tiny-qwen3.5-moe-nvfp4", (1, 2), ("golden", "shards"), r"weight_scale_2",
          tp1_green=False),
    Entry("CUDA graph static input not refreshed", "graph-stale-positions", "tiny-llama", (1,),
          ("golden",), r"CUDA graph replay differs from eager decode at batch \d+: prompt \d+ "
          r"step \d+", tp1_green=False, device="cuda"),
)
