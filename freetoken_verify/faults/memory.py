"""Memory faults: a loader that keeps or builds extra copies of the weights, and per-rank
caches sized from global head counts. The `memory` check exists to catch them."""

from __future__ import annotations

import torch

import freetoken.engine.core as core
from freetoken.distributed import get_tp_info
from freetoken.loading import loader
from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet
from freetoken_verify.faults._patch import after_load
from freetoken_verify.faults.registry import Entry, fault


@fault("keep-shard-copies", proven_by="tests/verify/test_memory_check.py")
def keep_shard_copies() -> None:
    """The loader keeps every shard it copied into a parameter (a forgotten cache): each rank
    holds its weights twice."""

    def patch(model, reader, plan):
        tp = get_tp_info()
        model.kept_shards = [plan.shard(name, reader.get(name), tp.rank)
                             for name in reader.names() if plan.resolve(name).param]

    after_load(patch)


@fault("double-copy-load", proven_by="tests/verify/test_memory_check.py")
def double_copy_load() -> None:
    """The loader builds every shard as a fresh tensor (`spec.shard`) and then copies it into
    its parameter, as it did before shards were copied straight into place: each tensor is
    copied twice and the host holds one shard more than the parameters (on a GPU, the whole
    shard in pageable memory), every shard on its own (no batched small runs)."""

    def copy(job, stager):
        tp = get_tp_info()
        job.dest.copy_(job.spec.shard(job.full, tp.rank, tp.size, job.name))

    loader._copy_shard = copy
    loader.SMALL_RUN_BYTES = 0


@fault("kv-cache-global-heads",
       Entry("KV cache sized with the global KV heads", "tiny-llama", (2,), ("memory",),
             r"KV cache is \d+ bytes"))
def kv_cache_global_heads() -> None:
    """The per-rank paged KV cache is sized with the global `num_key_value_heads` instead of
    the rank's local KV heads: every rank allocates the whole model's cache."""

    original = core.EngineCore._allocate_cache

    def allocate(self):
        allocate_kv_cache = core.allocate_kv_cache
        heads = self.model_config.num_key_value_heads
        core.allocate_kv_cache = lambda layers, blocks, block_size, _local, *rest: \
            allocate_kv_cache(layers, blocks, block_size, heads, *rest)
        try:
            return original(self)
        finally:
            core.allocate_kv_cache = allocate_kv_cache

    core.EngineCore._allocate_cache = allocate


@fault("gdn-state-global-heads",
       Entry("GatedDeltaNet state sized with the global value heads", "tiny-qwen3.5-moe", (2,),
             ("memory",), r"GatedDeltaNet recurrent state is \d+ bytes"))
def gdn_state_global_heads() -> None:
    """GatedDeltaNet's recurrent state is sized with the global `linear_num_value_heads`
    instead of the rank's local value heads."""

    original = GatedDeltaNet.allocate_state

    def allocate_state(self, num_slots, dtype, device):
        original(self, num_slots, dtype, device)
        heads = self.num_v_heads * get_tp_info().size
        self.recurrent_state = torch.zeros(num_slots, heads, self.head_k_dim, self.head_v_dim,
                                           dtype=torch.float32, device=device)

    GatedDeltaNet.allocate_state = allocate_state


QUANTIZED_FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def _quantized_layers(model):
    """Every layer of `model` that computes through a quantization method."""
    return [m for m in model.modules() if getattr(m, "quant", None) is not None]


@fault("dequantize-at-load",
       Entry("quantized weights dequantized at load", "tiny-qwen3.5-moe-fp8", (1, 2), ("memory",),
             r"expected \d+ bytes from the config", tp1_green=False))
def dequantize_at_load() -> None:
    """The quantized linear layers dequantize their weights once, after loading, and keep the
    dense weight in the model dtype in place of the packed weight and its scales: the
    outputs do not change, the weights take 2x (FP8) to 8x (NVFP4) the memory in bf16."""

    def patch(model, reader, plan):
        dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point
                     and p.dtype.itemsize > 1)
        for layer in _quantized_layers(model):
            dense = layer.quant.dequantize(layer, dtype)
            for name in QUANTIZED_FIELDS:
                if name in layer._parameters:
                    delattr(layer, name)
            layer.weight = torch.nn.Parameter(dense, requires_grad=False)
            layer.quant = None

    after_load(patch)


@fault("quantized-shard-views",
       Entry("quantized shards kept as views of the full checkpoint tensors",
             "tiny-qwen3.5-moe-fp8", (2,), ("memory",), r"view|pins|own"))
def quantized_shard_views() -> None:
    """The quantized layers keep their packed / e4m3 weight as a `narrow()` view of a
    full-size (tp x) buffer, as a loader slicing the whole checkpoint tensor in memory
    would: every rank pins tp times its share of those weights."""

    def patch(model, reader, plan):
        tp = get_tp_info()
        for layer in _quantized_layers(model):
            rows = layer.weight.shape[0]
            full = torch.cat([layer.weight.data] * tp.size)
            layer.weight.data = full.narrow(0, tp.rank * rows, rows)

    after_load(patch)
