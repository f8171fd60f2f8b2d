"""Architecture name -> model class and shard plan."""

from __future__ import annotations

from torch import nn

from freetoken.config import ModelConfig
from freetoken.loading.plan import ShardPlan
from freetoken.models.llama import LlamaForCausalLM
from freetoken.models.qwen3 import Qwen3ForCausalLM
from freetoken.models.qwen3_5_moe.model import Qwen35MoeForCausalLM
from freetoken.models.qwen3_5_moe.plan import qwen3_5_moe_plan
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM
from freetoken.models.shard_rules import decoder_plan

MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_5_moe": Qwen35MoeForCausalLM,
}
PLANS = {"llama": decoder_plan, "qwen3": decoder_plan, "qwen3_moe": decoder_plan,
         "qwen3_5_moe": qwen3_5_moe_plan}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The rank-local model for `cfg` (the TP size comes from `get_tp_info()`)."""
    return MODELS[cfg.arch](cfg)


def shard_plan(cfg: ModelConfig, tp_size: int) -> ShardPlan:
    """The declarative shard plan for `cfg` at `tp_size` ranks."""
    return PLANS[cfg.arch](cfg, tp_size)


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """Raise a ValueError naming the first dimension `tp_size` cannot split."""
    from freetoken.distributed import divide
    from freetoken.layers.linear import local_kv_heads

    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    divide(cfg.num_attention_heads, tp_size, "num_attention_heads")
    local_kv_heads(cfg.num_key_value_heads, tp_size)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        divide(cfg.intermediate_size, tp_size, "intermediate_size")
    if cfg.num_experts:
        divide(cfg.moe_intermediate_size, tp_size, "moe_intermediate_size")
    if cfg.arch == "qwen3_5_moe":
        divide(cfg.linear_num_key_heads, tp_size, "linear_num_key_heads")
        divide(cfg.linear_num_value_heads, tp_size, "linear_num_value_heads")
        divide(cfg.shared_expert_intermediate_size, tp_size, "shared_expert_intermediate_size")
    if getattr(cfg, "nvfp4_experts", False):
        _check_nvfp4_experts(cfg, tp_size)


def _check_nvfp4_experts(cfg: ModelConfig, tp_size: int) -> None:
    """NVFP4 experts split their inputs (down_proj's) on 16-element group boundaries: a
    ValueError naming the dimension before any rank starts."""
    from freetoken.formats.nvfp4.format import GROUP
    from freetoken.formats.nvfp4.specs import local_inputs

    if cfg.hidden_size % GROUP:
        raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of the "
                         f"{GROUP}-element NVFP4 group")
    local_inputs(cfg.moe_intermediate_size, tp_size, "moe_intermediate_size")
