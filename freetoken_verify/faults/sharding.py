"""Sharding and loading TP bugs for `--fault`: a packed tensor cut as one plain chunk, a shard
from the wrong rank, views of the checkpoint kept instead of copies, a reduction dropped."""

from __future__ import annotations

import torch

from freetoken.distributed import get_tp_info
from freetoken.formats import specs
from freetoken.formats.specs import Heads, Split
from freetoken.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from freetoken.layers.moe import FusedExperts
from freetoken_verify.faults._patch import after_load, checkpoint_name, respec
from freetoken_verify.faults.registry import Entry, fault


@fault("plain-chunk-gate-up",
       Entry("dense gate|up split as one plain chunk", "tiny-llama", (2,), ("golden",),
             r"first divergence: prefill/model\.layers\.0\.mlp\.gate_up_proj"))
def plain_chunk_gate_up() -> None:
    """Fill each merged gate|up weight with a plain row chunk of the packed `[gate; up]` instead
    of splitting gate and up separately: rank 0 of 2 gets all of gate, rank 1 all of up."""

    def patch(model, reader, plan):
        tp = get_tp_info()
        for name, module in model.named_modules():
            if isinstance(module, MergedColumnParallelLinear) and name.endswith("gate_up_proj"):
                mlp = name.rsplit(".", 1)[0]
                packed = torch.cat([reader.get(f"{mlp}.gate_proj.weight"),
                                    reader.get(f"{mlp}.up_proj.weight")])
                module.weight.data.copy_(Split(0).shard(packed, tp.rank, tp.size))

    after_load(patch)


@fault("drop-allreduce",
       Entry("row-parallel all-reduce dropped", "tiny-qwen3", (2,), ("bisect",),
             r"self_attn\.o_proj \(rank 1 holds a different"))
def drop_row_parallel_allreduce() -> None:
    """Row-parallel linears return their partial sums without the all-reduce."""

    RowParallelLinear.forward = lambda self, x: torch.nn.functional.linear(x, self.weight,
                                                                           self.bias)


@fault("kv-head-wrong-rank",
       Entry("KV head on the wrong rank", "tiny-llama", (4,), ("golden",), r"self_attn\.qkv_proj"))
def kv_head_wrong_rank() -> None:
    """With fewer KV heads than ranks, each rank loads the KV head of the next rank over."""

    def owner(self, rank, size):
        return (rank * self.num_heads // size + 1) % self.num_heads

    Heads._head_owner = owner


def _plain_chunk(spec) -> Split:
    """A plain row chunk (dim 0), whatever the rule's own spec was."""
    return Split(0)


@fault("plain-chunk-gdn-qkv",
       Entry("GDN in_proj_qkv split as one plain chunk", "tiny-qwen3.5-moe", (2,), ("golden",),
             r"linear_attn\.in_proj"))
def plain_chunk_gdn_qkv() -> None:
    """GatedDeltaNet in_proj_qkv split as a plain row chunk instead of per q / k / v segment."""
    respec("qwen3_5_moe", ("in_proj_qkv",), _plain_chunk)


@fault("plain-chunk-gdn-conv1d",
       Entry("GDN conv1d split as one plain chunk", "tiny-qwen3.5-moe", (2,), ("golden",),
             r"linear_attn\.conv1d"))
def plain_chunk_gdn_conv1d() -> None:
    """GatedDeltaNet conv1d split as a plain row chunk instead of per q / k / v segment."""
    respec("qwen3_5_moe", ("conv1d",), _plain_chunk)


@fault("plain-chunk-q-gate",
       Entry("gated-attention q|gate split at the midpoint", "tiny-qwen3.5-moe", (2,), ("golden",),
             r"self_attn\.qkv_proj", tp1_green=False))
def plain_chunk_q_gate() -> None:
    """Gated-attention q_proj (rows interleaved per head as [q_h | gate_h]) split as a plain
    row chunk: correct only by accident of layout, wrong whenever heads per rank > 1."""
    respec("qwen3_5_moe", ("q_proj",), _plain_chunk)


@fault("plain-chunk-expert-gate-up",
       Entry("expert gate|up split as one plain chunk", "tiny-qwen3-moe", (2,), ("golden",),
             r"mlp\.experts"))
def plain_chunk_expert_gate_up() -> None:
    """Each expert's w13 filled with a plain row chunk of the packed `[gate_e; up_e]` instead
    of gate and up split separately."""

    def patch(model, reader, plan):
        tp, names = get_tp_info(), reader.names()
        for name, module in model.named_modules():
            if not isinstance(module, FusedExperts):
                continue
            layer = name.split(".")[2]
            for e in range(module.num_experts):
                gate = checkpoint_name(names, f"layers.{layer}.mlp.experts.{e}.gate_proj.weight")
                packed = torch.cat([reader.get(gate), reader.get(gate.replace("gate_", "up_"))])
                module.w13.data[e].copy_(Split(0).shard(packed, tp.rank, tp.size))

    after_load(patch)


def _view_chunk(full, dim, rank, size, name):
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


@fault("shard-views",
       Entry("shards are views of the checkpoint", "tiny-llama", (1, 2), ("shards",), r"view",
             tp1_green=False))
def shard_views() -> None:
    """Shard functions return `narrow()` views of the checkpoint tensor instead of copies."""

    specs._chunk = _view_chunk
    specs.Replicate.shard = lambda self, full, rank, size, name="": full


@fault("split-replicated",
       Entry("replicated tensors split", "tiny-qwen3", (2,), ("golden", "shards"),
             r"layernorm|norm\.weight"))
def split_replicated() -> None:
    """Tensors meant to be replicated (norms, routers) are split across ranks instead."""

    specs.Replicate.shard = lambda self, full, rank, size, name="": _view_chunk(
        full, 0, rank, size, name).clone()
    specs.Replicate.pieces = lambda self, full, rank, size, name="": specs.whole(_view_chunk(
        full, 0, rank, size, name))
    specs.Replicate.unshard = lambda self, parts, name="": torch.cat(parts)


@fault("vocab-pad-dropped",
       Entry("vocab padding dropped", "tiny-llama", (2, 4), ("golden", "shards"),
             r"embed_tokens|lm_head"))
def vocab_pad_dropped() -> None:
    """Vocab-parallel rows are cut in ceil(vocab / tp) chunks without padding, so the last
    rank gets a short shard."""

    def rows(self, full, rank, size, name=""):
        step = -(-self.full_size // size)
        return full[rank * step : (rank + 1) * step]

    specs.PaddedSplit.shard = lambda *args: rows(*args).clone()
    specs.PaddedSplit.pieces = lambda *args: specs.whole(rows(*args))


@fault("pin-checkpoint-views",
       Entry("loader pins the checkpoint", "tiny-llama", (1, 2), ("memory",), r"pins",
             tp1_green=False))
def pin_checkpoint_views() -> None:
    """The loader keeps a view of every checkpoint tensor it read (as when shards are
    `narrow()` views stored beside the parameters) and whole-tensor parameters point at such
    views: every rank pins the entire checkpoint."""

    def patch(model, reader, plan):
        kept = {name: reader.get(name) for name in reader.names()
                if plan.resolve(name).param is not None}
        params, tp = dict(model.named_parameters()), get_tp_info()
        for name, full in kept.items():
            target = plan.resolve(name)
            if target.param in params and not target.slot:
                param = params[target.param]
                dims = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
                param.data = _view_chunk(full, dims[0], tp.rank, tp.size, name) if dims else full
        model.kept_checkpoint_views = kept

    after_load(patch)
