"""Qwen3.5-MoE (the family of Qwen/Qwen3.6-35B-A3B): hybrid GatedDeltaNet (linear attention)
and gated full-attention layers, every layer followed by a sparse MoE block with a gated shared
expert. One idea per module: config, quantization, attention, gdn, moe, model, plan."""
