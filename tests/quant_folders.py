"""Quantized checkpoint folders written from the bundled cases in the layouts that ship, for
the harness checks' tests (the model tests keep their own, with twins):

- `block-fp8`: Qwen's block FP8 on tiny-qwen3.5-moe (attention, GDN in_proj_qkv / in_proj_z
  / out_proj, shared expert, routed experts; 24 x 40 blocks, so heads cut through blocks,
  in_proj_qkv's k starts mid-block and at TP 8 ranks share blocks);
- `block-fp8-dense`: the same on tiny-llama;
- `modelopt-mixed`: NVIDIA's mixed layout (NVFP4 routed experts and lm_head, FP8 per tensor
  attention, GDN qkv / z / out and shared expert, in_proj_b / in_proj_a bf16);
- `ct-nvfp4`: RedHatAI's compressed-tensors NVFP4 (attention and routed experts; the split
  name ignore list over linear_attn, routers, shared-expert gates, the shared expert (its 48
  rows split on no 16-element group past TP 1) and lm_head);
- `modelopt-fp8-dense`: ModelOpt FP8 per tensor on every projection of tiny-llama."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import GOLDEN

from freetoken.formats.fp8.convert import write_block_fp8, write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin

P = "model.language_model.layers"
NVFP4_CASE = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
BLOCK = (24, 40)
QWEN_KEEP = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_b",
             "in_proj_a")
FP8 = {"quant_algo": "FP8"}
NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def _layer_types() -> list[str]:
    return json.loads((NVFP4_CASE / "config.json").read_text())["text_config"]["layer_types"]


def _mixed_layers() -> dict:
    layers = {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    for i, kind in enumerate(_layer_types()):
        layers[f"{P}.{i}.mlp.experts"] = {"quant_algo": "NVFP4", "group_size": 16}
        layers[f"{P}.{i}.mlp.shared_expert"] = FP8
        names = ([f"self_attn.{x}_proj" for x in "qkvo"] if kind == "full_attention" else
                 [f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "out_proj")])
        layers.update({f"{P}.{i}.{n}": FP8 for n in names})
    return layers


def _redhat_config() -> dict:
    ignore = ["lm_head"]
    for i, kind in enumerate(_layer_types()):
        ignore += [f"{P}.{i}.mlp.gate", f"{P}.{i}.mlp.shared_expert_gate"]
        ignore += [f"{P}.{i}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
        if kind == "linear_attention":
            a = f"{P}.{i}.linear_attn"
            ignore += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            ignore += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": ignore, "config_groups": {"group_0": {"targets": ["Linear"],
                                                            "weights": NVFP4_WEIGHTS}}}


def make_quantized_folders(root: Path) -> dict[str, Path]:
    """Every folder of the module docstring under `root`, by name."""
    mixed = {"producer": {"name": "modelopt"},
             "quantization": {"quant_algo": "MIXED_PRECISION",
                              "quantized_layers": _mixed_layers()}}
    base = write_dequantized_twin(NVFP4_CASE, root / "nvfp4-base",
                                  read_quant_config(NVFP4_CASE))
    return {
        "block-fp8": write_block_fp8(GOLDEN / "tiny-qwen3.5-moe", root / "block-fp8", BLOCK,
                                     QWEN_KEEP),
        "block-fp8-dense": write_block_fp8(GOLDEN / "tiny-llama", root / "block-fp8-dense",
                                           BLOCK, ("lm_head", "model.embed_tokens")),
        "modelopt-mixed": write_nvfp4(write_modelopt_fp8(NVFP4_CASE, root / "fp8-only",
                                                         _mixed_layers()),
                                      root / "modelopt-mixed", mixed, modules="lm_head"),
        "ct-nvfp4": write_nvfp4(base, root / "ct-nvfp4", _redhat_config()),
        "modelopt-fp8-dense": write_modelopt_fp8(GOLDEN / "tiny-llama",
                                                 root / "modelopt-fp8-dense"),
    }
