"""Qwen3.5-MoE checkpoints for verification, in the on-disk format of Qwen/Qwen3.6-35B-A3B
(`Qwen3_5MoeForConditionalGeneration`: a multimodal config.json with `text_config`, text
weights under `model.language_model.`, a vision tower under `model.visual.`, experts stored per
expert), built and saved by HF transformers itself.

- `qwen3_5_moe_tiny`: the bundled `tiny-qwen3.5-moe` case (dimensions valid at TP 1, 2, 4, 8).
- `qwen3_5_moe_tiny_nvfp4`: the same with NVFP4-splittable experts (`tiny-qwen3.5-moe-nvfp4`).
- `qwen3_5_moe_tiny_quantized`: the same with NVFP4-splittable experts and shared expert
  (`tiny-qwen3.5-moe-nvfp4-ct`, `tiny-qwen3.5-moe-mixed`).
- `write_realdims`: `qwen3.5-moe-realdims`, the real model's text dimensions with 2 layers
  (one GatedDeltaNet, one full attention) or any number, in bf16 or a shipping quantized
  layout (`realdims`), written on demand for GPU runs, never bundled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from freetoken_verify.cases.randomise import rerandomise
from freetoken_verify.cases.realdims import quantize_checkpoint
from freetoken_verify.cases.tiny import VOCAB
from freetoken_verify.cases.tokenizer import write_tokenizer

TINY_TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    # dk != dv and key total (8 x 16 = 128) != value total (16 x 12 = 192), so a mix-up of
    # key and value head dims or totals cannot pass; 2 value heads per key head.
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=16,
    linear_value_head_dim=12, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, max_position_embeddings=512, rms_norm_eps=1e-6,
    # rotary_dim = 32 * 0.25 = 8, i.e. 4 frequencies = the mrope sections' sum, as in the
    # real config (64 = 2 * (11 + 11 + 10)).
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    tie_word_embeddings=False,
)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                   patch_size=2, temporal_patch_size=1, spatial_merge_size=2,
                   num_position_embeddings=16)

# Qwen3.6-35B-A3B's text_config as published (hidden 2048, 40 layers in 10 x (3 GatedDeltaNet
# + 1 full attention), 16 q / 2 KV heads of 256, GatedDeltaNet 16 key / 32 value heads of 128,
# conv kernel 4, 256 experts top-8 of 512, one shared expert of 512, vocab 248320 padded, rope
# theta 1e7 on a quarter of each head with interleaved mrope sections 11/11/10), cut to 2 layers.
# These agree with transformers' Qwen3_5MoeTextConfig defaults. The vision tower is kept tiny
# (the engine ignores it), so the folder holds the text model at full width only.
REAL_TEXT = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                     "mrope_interleaved": True},
    tie_word_embeddings=False,
)
REAL_SEED = 35


def _conditional_generation(text: dict, eos: int):
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(text_config=dict(text, eos_token_id=eos),
                              vision_config=TINY_VISION, tie_word_embeddings=False)
    return Qwen3_5MoeForConditionalGeneration(config)


def qwen3_5_moe_tiny(eos: int):
    """The bundled case's HF model (HF's init; `rerandomise` follows)."""
    return _conditional_generation(TINY_TEXT, eos)


def qwen3_5_moe_tiny_nvfp4(eos: int):
    """The `tiny-qwen3.5-moe-nvfp4` case's HF model: `tiny-qwen3.5-moe` with
    moe_intermediate_size 128, so each of 8 ranks holds 16 of down_proj's NVFP4 inputs (one
    whole group; 32 / 8 = 4 would cut one)."""
    return _conditional_generation(dict(TINY_TEXT, moe_intermediate_size=128), eos)


def qwen3_5_moe_tiny_quantized(eos: int):
    """The HF model of the quantized cases with NVFP4 dense linears (`tiny-qwen3.5-moe-nvfp4-ct`,
    `tiny-qwen3.5-moe-mixed`): `tiny-qwen3.5-moe` with routed and shared experts 128 wide, so
    that at TP 8 each rank's down_proj inputs are one whole 16-element NVFP4 group (the shared
    expert's 48 / 8 = 6 would cut one)."""
    return _conditional_generation(dict(TINY_TEXT, moe_intermediate_size=128,
                                        shared_expert_intermediate_size=128), eos)


def realdims_text(num_layers: int = 2) -> dict:
    """REAL_TEXT with `num_layers` layers: the 2-layer preset's GatedDeltaNet + full attention,
    or (more layers) the real model's pattern of 3 GatedDeltaNet layers then one attention."""
    if num_layers == 2:
        return dict(REAL_TEXT)
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    return dict(REAL_TEXT, num_hidden_layers=num_layers,
                layer_types=[pattern[i % 4] for i in range(num_layers)])


def write_realdims(folder: str | Path, dtype: str = "bfloat16", fmt: str = "bf16",
                   num_layers: int = 2, device: str = "cpu") -> Path:
    """Write `qwen3.5-moe-realdims` into `folder`: weights (re-randomised like the bundled
    cases), config.json and the bundled cases' tokenizer, in `fmt` (`realdims.FORMATS`: bf16,
    or a shipping quantized layout converted from it, quantized on `device`). No reference
    outputs: verify it with `freetoken-verify --model FOLDER` (HF is run live on bf16, on the
    dequantized twin otherwise). About 2.7e9 parameters at 2 layers: 5.4 GB in bfloat16;
    building it needs roughly twice that in host memory."""
    folder = Path(folder)
    master = folder if fmt == "bf16" else folder.with_name(folder.name + ".bf16")
    master.mkdir(parents=True, exist_ok=True)
    eos = write_tokenizer(master)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        torch.manual_seed(REAL_SEED)
        model = _conditional_generation(realdims_text(num_layers), eos).eval()
    finally:
        torch.set_default_dtype(previous)
    rerandomise(model, REAL_SEED)
    # One file: the format writers read one model.safetensors.
    model.save_pretrained(master, max_shard_size="1000GB")
    del model
    config = json.loads((master / "config.json").read_text())
    config["dtype"] = dtype
    (master / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "bf16":
        return folder
    try:
        return quantize_checkpoint(master, folder, fmt, device=device)
    finally:
        shutil.rmtree(master, ignore_errors=True)
