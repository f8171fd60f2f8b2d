"""Canonical TP bugs, injectable into the engine with `freetoken-verify --fault NAME`.

Each fault monkeypatches the engine inside the process that calls it (every rank, before
the checks run). They exist to show that the checks catch the bugs they are meant for: a
harness that stays green with a fault injected is broken."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

import freetoken.engine.core as core
from freetoken.distributed import get_tp_info
from freetoken.formats import specs
from freetoken.formats.specs import Heads, Split
from freetoken.kernels import nvfp4_linear, nvfp4_moe
from freetoken.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from freetoken.layers.moe import FusedExperts
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.loading.plan import ShardPlan
from freetoken.models import registry
from freetoken_verify.faults.backend import torch_nvfp4_drop_w13_global, torch_nvfp4_nibble_swap
from freetoken_verify.faults.collectives import (
    allreduce_contiguous_copy,
    embedding_extra_allreduce,
    lm_head_no_gather,
    moe_reduce_routed_and_shared_separately,
)
from freetoken_verify.faults.graphs import GRAPH_FAULTS
from freetoken_verify.faults.invariant import INVARIANT_FAULTS
from freetoken_verify.faults.kernels import KERNEL_FAULTS
from freetoken_verify.faults.layout import (
    gdn_heads_from_first,
    nvfp4_scale_group_shifted,
    plain_chunk_gdn_zba,
    plain_chunk_shared_gate_up,
)
from freetoken_verify.faults.memory import (
    dequantize_at_load,
    double_copy_load,
    gdn_state_global_heads,
    keep_shard_copies,
    kv_cache_global_heads,
    quantized_shard_views,
)
from freetoken_verify.faults.port_mistakes import BUGS
from freetoken_verify.faults.quant_config import QUANT_CONFIG_FAULTS
from freetoken_verify.faults.quant_kernels import QUANT_KERNEL_FAULTS
from freetoken_verify.faults.scales import SCALE_FAULTS
from freetoken_verify.faults.where import WHERE_FAULTS


def plain_chunk_gate_up() -> None:
    """Fill each merged gate|up weight with a plain row chunk of the packed `[gate; up]` instead
    of splitting gate and up separately: rank 0 of 2 gets all of gate, rank 1 all of up."""

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

    RowParallelLinear.forward = lambda self, x: torch.nn.functional.linear(x, self.weight,
                                                                           self.bias)


def kv_head_wrong_rank() -> None:
    """With fewer KV heads than ranks, each rank loads the KV head of the next rank over."""

    def owner(self, rank, size):
        return (rank * self.num_heads // size + 1) % self.num_heads

    Heads._head_owner = owner


def _view_chunk(full, dim, rank, size, name):
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


def shard_views() -> None:
    """Shard functions return `narrow()` views of the checkpoint tensor instead of copies."""

    specs._chunk = _view_chunk
    specs.Replicate.shard = lambda self, full, rank, size, name="": full


def split_replicated() -> None:
    """Tensors meant to be replicated (norms, routers) are split across ranks instead."""

    specs.Replicate.shard = lambda self, full, rank, size, name="": _view_chunk(
        full, 0, rank, size, name).clone()
    specs.Replicate.pieces = lambda self, full, rank, size, name="": specs.whole(_view_chunk(
        full, 0, rank, size, name))
    specs.Replicate.unshard = lambda self, parts, name="": torch.cat(parts)


def vocab_pad_dropped() -> None:
    """Vocab-parallel rows are cut in ceil(vocab / tp) chunks without padding, so the last
    rank gets a short shard."""

    def rows(self, full, rank, size, name=""):
        step = -(-self.full_size // size)
        return full[rank * step : (rank + 1) * step]

    specs.PaddedSplit.shard = lambda *args: rows(*args).clone()
    specs.PaddedSplit.pieces = lambda *args: specs.whole(rows(*args))


def pin_checkpoint_views() -> None:
    """The loader keeps a view of every checkpoint tensor it read (as when shards are
    `narrow()` views stored beside the parameters) and whole-tensor parameters point at such
    views: every rank pins the entire checkpoint."""

    original = core.load_weights

    def load(model, reader, plan, progress=True):
        kept, read = {}, reader.get
        reader.get = lambda name: kept.setdefault(name, read(name))
        out = original(model, reader, plan, progress)
        params, tp = dict(model.named_parameters()), get_tp_info()
        for name, full in kept.items():
            target = plan.resolve(name)
            if target.param in params and not target.slot:
                param = params[target.param]
                dims = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
                param.data = _view_chunk(full, dims[0], tp.rank, tp.size, name) if dims else full
        model.kept_checkpoint_views = kept
        return out

    core.load_weights = load


def _plain_chunk_rules(arch: str, needle: str) -> None:
    """Replace the spec of every `arch` plan rule whose pattern contains `needle` with a plain
    row chunk (dim 0), keeping destinations as they are."""

    original = registry.ARCHITECTURES[arch].plan

    def plan(cfg, tp):
        rules = [dataclasses.replace(r, spec=Split(0)) if needle in r.pattern else r
                 for r in original(cfg, tp).rules]
        return ShardPlan(rules, tp)

    registry.ARCHITECTURES[arch] = dataclasses.replace(registry.ARCHITECTURES[arch], plan=plan)


def plain_chunk_gdn_qkv() -> None:
    """GatedDeltaNet in_proj_qkv split as a plain row chunk instead of per q / k / v segment."""
    _plain_chunk_rules("qwen3_5_moe", "in_proj_qkv")


def plain_chunk_gdn_conv1d() -> None:
    """GatedDeltaNet conv1d split as a plain row chunk instead of per q / k / v segment."""
    _plain_chunk_rules("qwen3_5_moe", "conv1d")


def plain_chunk_q_gate() -> None:
    """Gated-attention q_proj (rows interleaved per head as [q_h | gate_h]) split as a plain
    row chunk: correct only by accident of layout, wrong whenever heads per rank > 1."""
    _plain_chunk_rules("qwen3_5_moe", "q_proj")


def plain_chunk_expert_gate_up() -> None:
    """Each expert's w13 filled with a plain row chunk of the packed `[gate_e; up_e]` instead
    of gate and up split separately."""

    original = core.load_weights

    def load(model, reader, plan, progress=True):
        out = original(model, reader, plan, progress)
        tp, names = get_tp_info(), reader.names()
        for name, module in model.named_modules():
            if not isinstance(module, FusedExperts):
                continue
            layer = name.split(".")[2]
            for e in range(module.num_experts):
                gate = next(n for n in names if n.endswith(
                    f"layers.{layer}.mlp.experts.{e}.gate_proj.weight"))
                packed = torch.cat([reader.get(gate), reader.get(gate.replace("gate_", "up_"))])
                module.w13.data[e].copy_(Split(0).shard(packed, tp.rank, tp.size))
        reader.close()
        return out

    core.load_weights = load


def _wrap_nvfp4_moe(transform: Callable[[dict], dict]) -> None:
    """Pass `fused_moe`'s arguments through `transform` before the NVFP4 kernels see them, so
    the kernels compute exactly what a kernel with the bug would."""

    original = nvfp4_moe.fused_moe
    signature = inspect.signature(original)

    def fused_moe(*args, **kwargs):
        return original(**transform(dict(signature.bind(*args, **kwargs).arguments)))

    nvfp4_moe.fused_moe = fused_moe


def _swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return (packed << 4) | (packed >> 4)


def nvfp4_nibble_swap() -> None:
    """The NVFP4 kernels unpack element 2j from the high nibble and 2j + 1 from the low one
    (ModelOpt stores the even element in the low nibble)."""

    _wrap_nvfp4_moe(lambda a: {**a, "w13": _swap_nibbles(a["w13"]),
                               "w2": _swap_nibbles(a["w2"])})
    original = nvfp4_linear.nvfp4_linear

    def linear(x, packed, *args, **kwargs):
        return original(x, _swap_nibbles(packed), *args, **kwargs)

    nvfp4_linear.nvfp4_linear = linear


def nvfp4_drop_global_scale() -> None:
    """The NVFP4 down projection forgets its per-expert global scale (`weight_scale_2`)."""
    _wrap_nvfp4_moe(lambda a: {**a, "w2_global": torch.ones_like(a["w2_global"])})


def nvfp4_gate_up_globals_swapped() -> None:
    """The NVFP4 gate rows get the up projection's global scale and vice versa."""
    _wrap_nvfp4_moe(lambda a: {**a, "w13_global": a["w13_global"].flip(-1)})


def nvfp4_intermediate_off_by_group() -> None:
    """The NVFP4 kernels are told a TP-local intermediate size one 16-element group short:
    the up rows start 16 rows early and the last group of down's inputs is dropped."""

    nvfp4_moe._local_intermediate = lambda w13, w2: w13.shape[1] // 2 - 16


def nvfp4_load_globals_swapped() -> None:
    """Loading NVFP4 experts puts each expert's up global scale (`weight_scale_2`) on its gate
    rows and the gate's on its up rows."""

    original = core.load_weights

    def load(model, reader, plan, progress=True):
        out = original(model, reader, plan, progress)
        for module in model.modules():
            if isinstance(module, NVFP4FusedExperts):
                module.w13_weight_scale_2.data = module.w13_weight_scale_2.data.flip(1)
        return out

    core.load_weights = load


FAULTS: dict[str, Callable[[], None]] = {
    "plain-chunk-gate-up": plain_chunk_gate_up,
    "drop-allreduce": drop_row_parallel_allreduce,
    "kv-head-wrong-rank": kv_head_wrong_rank,
    "plain-chunk-gdn-qkv": plain_chunk_gdn_qkv,
    "plain-chunk-gdn-conv1d": plain_chunk_gdn_conv1d,
    "plain-chunk-q-gate": plain_chunk_q_gate,
    "plain-chunk-expert-gate-up": plain_chunk_expert_gate_up,
    "shard-views": shard_views,
    "split-replicated": split_replicated,
    "vocab-pad-dropped": vocab_pad_dropped,
    "pin-checkpoint-views": pin_checkpoint_views,
    "keep-shard-copies": keep_shard_copies,
    "double-copy-load": double_copy_load,
    "kv-cache-global-heads": kv_cache_global_heads,
    "gdn-state-global-heads": gdn_state_global_heads,
    "dequantize-at-load": dequantize_at_load,
    "quantized-shard-views": quantized_shard_views,
    "nvfp4-load-globals-swapped": nvfp4_load_globals_swapped,
    "nvfp4-nibble-swap": nvfp4_nibble_swap,
    "nvfp4-drop-global-scale": nvfp4_drop_global_scale,
    "nvfp4-gate-up-globals-swapped": nvfp4_gate_up_globals_swapped,
    "nvfp4-intermediate-off-by-group": nvfp4_intermediate_off_by_group,
    "moe-reduce-separately": moe_reduce_routed_and_shared_separately,
    "embedding-extra-allreduce": embedding_extra_allreduce,
    "lm-head-no-gather": lm_head_no_gather,
    "allreduce-contiguous-copy": allreduce_contiguous_copy,
    **BUGS,
    "gdn-heads-from-first": gdn_heads_from_first,
    "plain-chunk-gdn-zba": plain_chunk_gdn_zba,
    "plain-chunk-shared-gate-up": plain_chunk_shared_gate_up,
    "block-scale-group-shifted": nvfp4_scale_group_shifted,
    "torch-nvfp4-nibble-swap": torch_nvfp4_nibble_swap,
    "torch-nvfp4-drop-w13-global": torch_nvfp4_drop_w13_global,
    **SCALE_FAULTS,
    **KERNEL_FAULTS,
    **QUANT_KERNEL_FAULTS,
    **QUANT_CONFIG_FAULTS,
    **GRAPH_FAULTS,
    **INVARIANT_FAULTS,
    **WHERE_FAULTS,
}


NVFP4_MOE_KERNEL_FAULTS = ("nvfp4-nibble-swap", "nvfp4-drop-global-scale",
                           "nvfp4-gate-up-globals-swapped", "nvfp4-intermediate-off-by-group")
"""The faults in the NVFP4 MoE Triton kernels' decode and scaling, which the kernels check's
NVFP4 matrix must catch on the GPU (`bench/gpu_kernels_check.py`); other `nvfp4-` faults are in
loading or in the torch quantized GEMMs."""


def inject(names: tuple[str, ...] | list[str]) -> None:
    """Apply the named faults in this process."""
    for name in names:
        FAULTS[name]()
