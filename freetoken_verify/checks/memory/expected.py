"""What a rank should hold after loading, computed from the model's config, the checkpoint's
headers and the engine's settings alone, never from what the engine allocated: a cache sized
from a global count (all KV heads, all value heads) on every rank then disagrees with it.

* parameters, per engine parameter: the tensors of quantized modules by their format's
  rule (`freetoken_verify.checks.memory.quantized`: packed NVFP4 bytes, e4m3 group scales and
  float32 globals; e4m3 FP8 weights and their float32 per-tensor or per-block scales, blocks
  two ranks share counted on both), every other tensor by its rank-local shape (its shard
  spec applied to a meta tensor of the header's shape) in the engine's dtype when floating,
  as stored otherwise;
* KV cache: 2 (k, v) x attention layers x blocks x block size x LOCAL KV heads (global / tp,
  or one when there are fewer heads than ranks) x head_dim x dtype bytes;
* GatedDeltaNet state, per linear-attention layer and sequence slot: conv state over the local
  channels (2 x key heads x dk + value heads x dv, over tp) x (kernel - 1) in the dtype, and
  the recurrent state of the local value heads, dk x dv each, in float32;
* where decode runs as CUDA graphs, one scratch cache block and one scratch state slot more
  (the padding rows of a graphed batch write there), not split across ranks."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.formats.nvfp4.specs import GlobalScale
from freetoken.formats.quant.format import UNQUANTIZED
from freetoken.loading import CheckpointReader
from freetoken.models.registry import load_config, shard_plan
from freetoken_verify.checks.memory.quantized import owners, tensor_bytes

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
KV_CACHE, CONV_STATE, RECURRENT_STATE = "KV cache", "GatedDeltaNet conv state", \
    "GatedDeltaNet recurrent state"
PARAMETERS = "parameters"


@dataclass(frozen=True)
class Part:
    """Bytes one rank should hold for one kind of memory and how they were computed;
    `split_bytes` of them are split across ranks, and TP=1 holds `split_tp1` of those.
    Parameters also by engine parameter (`by_param`: name -> (bytes, how)) and by format
    (`by_format`: `bf16 (unquantized)`, `FP8 block 128x128 (fp8)`, ... -> bytes)."""

    name: str
    nbytes: int
    formula: str
    split_bytes: int
    split_tp1: int
    by_param: dict = field(default_factory=dict, compare=False)
    by_format: dict = field(default_factory=dict, compare=False)


def expected_parts(folder: str, cfg: EngineConfig, dtype: torch.dtype, rank: int,
                   size: int, graphs: bool = False) -> dict[str, Part]:
    """The expected bytes of `rank` of `size`, by part (parameters, KV cache, GDN states);
    `graphs`: decode runs as CUDA graphs (a scratch block and state slot)."""

    model = load_config(folder)
    if cfg.num_layers is not None:
        model = model.truncated(cfg.num_layers)
    parts = [parameter_part(folder, model, cfg.num_layers, dtype, rank, size),
             kv_cache_part(model, cfg, dtype, size, int(graphs))]
    parts += gdn_state_parts(model, cfg, dtype, size, int(graphs))
    return {p.name: p for p in parts if p is not None}


def _attention_layers(model: ModelConfig) -> int:
    types = getattr(model, "layer_types", ())
    if not types:
        return model.num_hidden_layers
    return sum(t == "full_attention" for t in types)


def kv_cache_part(model: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, size: int,
                  scratch: int = 0) -> Part | None:
    layers = _attention_layers(model)
    if not layers:
        return None
    blocks = cfg.num_kv_blocks or cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
    kv = model.num_key_value_heads
    local = kv // size if kv >= size else 1
    item = dtype.itemsize
    per_block = 2 * layers * cfg.block_size * local * model.head_dim * item
    nbytes = (blocks + scratch) * per_block
    formula = (f"2 x {layers} layers x {blocks + scratch} blocks"
               f"{' (one scratch)' if scratch else ''} x {cfg.block_size} x {local} local KV "
               f"heads (num_key_value_heads={kv} at tp={size}) x head_dim {model.head_dim} "
               f"x {item} bytes")
    split = blocks * per_block if kv >= size else 0
    return Part(KV_CACHE, nbytes, formula, split, split * size)


def gdn_state_parts(model: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, size: int,
                    scratch: int = 0) -> list[Part]:
    layers = sum(t == "linear_attention" for t in getattr(model, "layer_types", ()))
    if not layers:
        return []
    slots, nk, nv = cfg.max_num_seqs, model.linear_num_key_heads, model.linear_num_value_heads
    dk, dv, kernel = model.linear_key_head_dim, model.linear_value_head_dim, \
        model.linear_conv_kernel_dim
    channels = (2 * nk * dk + nv * dv) // size
    conv = layers * slots * channels * (kernel - 1) * dtype.itemsize
    recurrent = layers * slots * (nv // size) * dk * dv * 4
    # The scratch slot's share: not split (every rank has one).
    extra, shown = (slots + scratch) / slots, slots + scratch
    label = f"{shown} slots{' (one scratch)' if scratch else ''}"
    return [
        Part(CONV_STATE, round(conv * extra), f"{layers} layers x {label} x {channels} local "
             f"channels ((2 x {nk} x {dk} + {nv} x {dv}) / tp={size}) x {kernel - 1} x "
             f"{dtype.itemsize} bytes", conv, conv * size),
        Part(RECURRENT_STATE, round(recurrent * extra), f"{layers} layers x {label} x "
             f"{nv // size} local value heads (linear_num_value_heads={nv} / tp={size}) x "
             f"{dk} x {dv} x 4 bytes", recurrent, recurrent * size),
    ]


def parameter_part(folder: str, model: ModelConfig, num_layers: int | None,
                   dtype: torch.dtype, rank: int, size: int) -> Part:
    """Rank-dependent: the bytes of this rank's share of every checkpoint tensor the plan
    loads, summed per engine parameter (and, padding aside, 1/size of the split tensors)."""

    reader = CheckpointReader(folder, num_layers)
    plan = shard_plan(model, size)
    quantized = owners(model)
    total = split = split_tp1 = 0
    by_param: dict[str, list] = defaultdict(lambda: [0, []])
    by_format: dict[str, int] = defaultdict(int)
    for name in reader.names():
        target = plan.resolve(name)
        if target.param is None:
            continue
        owner = quantized.get(name.rpartition(".")[0])
        counted = owner and tensor_bytes(model, owner, name, rank, size)
        if counted:
            (local, how), tp1 = counted, tensor_bytes(model, owner, name, 0, 1)[0]
        else:
            local, how, tp1 = _stored_bytes(reader, target, name, dtype, rank, size)
        total += local
        by_param[target.param][0] += local
        by_param[target.param][1].append(how)
        by_format[(owner.fmt if counted else UNQUANTIZED).describe()] += local
        # Split: every rank holds 1/size of it, give or take padding smaller than a shard.
        if size > 1 and 0 <= local * size - tp1 < local:
            split, split_tp1 = split + local, split_tp1 + tp1
    reader.close()
    return Part(PARAMETERS, total, "the checkpoint's tensors at "
                f"tp={size}: quantized modules by their format, the others through the shard "
                f"plan, floating ones in {str(dtype).removeprefix('torch.')}", split,
                split_tp1, {k: (v[0], "; ".join(v[1])) for k, v in by_param.items()},
                dict(by_format))


def _stored_bytes(reader, target, name: str, dtype, rank: int, size: int
                  ) -> tuple[int, str, int]:
    """(bytes on this rank, how, bytes of the whole tensor) of an unquantized tensor: its
    shard spec's rank-local shape, floating in the engine dtype."""
    shape, stored = reader.meta(name)
    full = torch.empty(shape, dtype=SAFETENSORS_DTYPES[stored], device="meta")
    local = tuple(target.rule.spec.pieces(full, rank, size, name).shape)
    item = _param_dtype(full.dtype, isinstance(target.rule.spec, GlobalScale), dtype).itemsize
    dims = " x ".join(map(str, local)) or "1"
    return (math.prod(local) * item, f"{name}: {dims} x {item} B",
            full.numel() * item)


def _param_dtype(stored: torch.dtype, global_scale: bool, dtype: torch.dtype) -> torch.dtype:
    if global_scale:
        return torch.float32
    if stored.is_floating_point and stored.itemsize > 1:
        return dtype
    return stored
