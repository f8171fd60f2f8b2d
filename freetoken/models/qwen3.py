"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (`ModelConfig.qk_norm`)."""

from freetoken.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
