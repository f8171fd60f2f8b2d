"""Quantized checkpoint folders in the layouts that ship, written from the bundled cases, for
every test that needs one (the harness checks, the shards layouts, the twin reference):

- block FP8 (`block_fp8`): Qwen's releases (`weight_scale_inv` per block, HF `fp8`) over
  tiny-qwen3.5-moe (attention, GDN in_proj_qkv / in_proj_z / out_proj, shared expert, routed
  experts; routers, b / a, embeddings and lm_head kept) or a dense / MoE decoder, with
  24 x 40 blocks, so heads cut through blocks, in_proj_qkv's k starts mid-block, at TP 8
  ranks share blocks and last blocks are partial; optionally with static activation scales;
- ModelOpt FP8 per tensor and ModelOpt NVFP4 on every tiny-llama projection but lm_head;
- compressed-tensors FP8 (block or per tensor) with static input scales on the same;
- NVIDIA's ModelOpt mixed layout (`modelopt_mixed`): NVFP4 routed experts and lm_head, FP8
  per tensor attention and GDN qkv / z / out, the shared expert FP8 or NVFP4, b / a bf16;
- RedHatAI's compressed-tensors NVFP4 (`compressed_tensors_nvfp4`, divisor globals):
  attention, routed experts (and the shared expert unless ignored) NVFP4, an expanded
  split-name ignore list over linear_attn, routers, shared-expert gates and lm_head;
- `split_in_two`: a folder's weights split into two files with an index;
- `with_tensor`: a folder's copy with one tensor set (or added), e.g. a broken input scale.

The NVFP4 layouts start from the bundled NVFP4 case, as stored or from its dequantized twin
(`nvfp4_base`), whose shared expert may be widened from 48 to 128 intermediate rows (new
rows random, seeded) so that its down_proj splits on 16-input groups at every TP size up to
8. `harness_folders` and `layout_folders` are the two sets the check tests run over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken.formats.fp8.convert import write_block_fp8, write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin

P = "model.language_model.layers"
NVFP4_CASE = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
BLOCK = (24, 40)
"""Blocks that cut q_proj's 32-row heads, start in_proj_qkv's k segment mid-block and make
ranks share blocks (`tests/models/test_qwen3_5_moe_fp8.py`)."""
QWEN35_NOT_CONVERT = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate",
                      "in_proj_b", "in_proj_a")
FP8 = {"quant_algo": "FP8"}
NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}
CT_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
SHARED_WIDTH = 128


def _layer_types() -> list[str]:
    return json.loads((NVFP4_CASE / "config.json").read_text())["text_config"]["layer_types"]


def _not_convert(case: str) -> tuple[str, ...]:
    if case == "tiny-qwen3.5-moe":
        return QWEN35_NOT_CONVERT
    return ("lm_head", "model.embed_tokens") + (("mlp.gate",) if "moe" in case else ())


def block_fp8_config(block: tuple[int, int] = BLOCK,
                     keep: tuple[str, ...] = QWEN35_NOT_CONVERT) -> dict:
    """Qwen's block-FP8 `quantization_config`."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(keep)}


def block_fp8(case: str, dst: Path, static_inputs: bool = False) -> Path:
    """Qwen's block-FP8 layout over the bundled `case` (`static_inputs`: with
    `activation_scheme: static` and an `activation_scale` per module)."""
    return write_block_fp8(GOLDEN / case, dst, BLOCK, _not_convert(case),
                           static_inputs=static_inputs)


def modelopt_fp8_llama(dst: Path) -> Path:
    return write_modelopt_fp8(GOLDEN / "tiny-llama", dst)


def compressed_tensors_fp8_llama(dst: Path, strategy: str) -> Path:
    """compressed-tensors FP8 on every tiny-llama projection but lm_head, `strategy` `block`
    (24 x 40) or `tensor`, with static input activations: each module's `weight`, its
    `weight_scale` and a 0-d `input_scale` (the block layout renamed from Qwen's, the tensor
    one from ModelOpt's, whose scales are the same)."""
    if strategy == "block":
        src = write_block_fp8(GOLDEN / "tiny-llama", dst.with_name(dst.name + "-hf"), BLOCK,
                              ("lm_head",), static_inputs=True)
        renames = {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}
        weights = {"strategy": "block", "block_structure": list(BLOCK)}
    else:
        src = write_modelopt_fp8(GOLDEN / "tiny-llama", dst.with_name(dst.name + "-modelopt"))
        renames, weights = {}, {"strategy": "tensor"}
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors",
                                                            "hf_quant_config.json"))
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        tensors[f"{module}.{renames.get(suffix, suffix)}"] = t
    save_file(tensors, dst / "model.safetensors")
    shutil.rmtree(src)
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {"targets": ["Linear"], "weights": {**fp8, **weights, "dynamic": False},
             "input_activations": {**fp8, "strategy": "tensor", "dynamic": False}}
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     "format": "float-quantized", "ignore": ["lm_head"],
                                     "config_groups": {"group_0": group}}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def modelopt_nvfp4_llama(dst: Path) -> Path:
    """ModelOpt NVFP4 on every Llama projection but lm_head (`weight_scale_2` multiplies)."""
    config = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    return write_nvfp4(GOLDEN / "tiny-llama", dst, config)


def nvfp4_base(dst: Path, widened: bool = False) -> Path:
    """The bundled NVFP4 case dequantized; `widened`: its shared expert widened to
    SHARED_WIDTH rows."""
    base = write_dequantized_twin(NVFP4_CASE, dst, read_quant_config(NVFP4_CASE))
    if not widened:
        return base
    tensors = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(26)
    for name in [n for n in tensors if ".shared_expert." in n]:
        t = tensors[name]
        dim = 1 if ".down_proj." in name else 0
        shape = list(t.shape)
        shape[dim] = SHARED_WIDTH - shape[dim]
        extra = torch.randn(shape, generator=gen, dtype=torch.float32) * t.float().std()
        tensors[name] = torch.cat([t, extra.to(t.dtype)], dim=dim).contiguous()
    save_file(tensors, base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["text_config"]["shared_expert_intermediate_size"] = SHARED_WIDTH
    (base / "config.json").write_text(json.dumps(config, indent=2))
    return base


def modelopt_mixed_config(shared_expert: dict = NVFP4) -> dict:
    """NVIDIA's Qwen3.6 layout (`hf_quant_config.json`): NVFP4 experts and lm_head; FP8 per
    tensor attention and GDN in_proj_qkv / in_proj_z / out_proj; the shared expert in
    `shared_expert` (FP8 or NVFP4)."""
    layers = {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    for i, kind in enumerate(_layer_types()):
        layers[f"{P}.{i}.mlp.experts"] = NVFP4
        layers[f"{P}.{i}.mlp.shared_expert"] = shared_expert
        names = ([f"self_attn.{x}_proj" for x in "qkvo"] if kind == "full_attention" else
                 [f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "out_proj")])
        layers.update({f"{P}.{i}.{n}": FP8 for n in names})
    return {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}


def modelopt_mixed(dst: Path, base: Path | None = None, shared_expert: dict = FP8) -> Path:
    """NVIDIA's MIXED_PRECISION layout (every module its own scale). `base` None: the
    bundled NVFP4 case, its experts already NVFP4, only lm_head quantized to NVFP4 here;
    else an unquantized base whose experts (and an NVFP4 shared expert) are quantized too."""
    doc = modelopt_mixed_config(shared_expert)
    layers = doc["quantization"]["quantized_layers"]
    fp8 = write_modelopt_fp8(NVFP4_CASE if base is None else base,
                             dst.with_name(dst.name + "-fp8-only"), layers)
    out = write_nvfp4(fp8, dst, doc, modules="lm_head" if base is None else r"lm_head|.*_proj")
    shutil.rmtree(fp8)
    return out


def redhat_config(ignore_shared_expert: bool = False) -> dict:
    """RedHatAI's layout (config.json `quantization_config`): every Linear NVFP4 but the
    expanded ignore list, which names HF's split modules (and the shared expert, whose 48
    rows split on no 16-element group past TP 1, when `ignore_shared_expert`)."""
    ignore = ["lm_head"]
    for i, kind in enumerate(_layer_types()):
        ignore += [f"{P}.{i}.mlp.gate", f"{P}.{i}.mlp.shared_expert_gate"]
        if ignore_shared_expert:
            ignore += [f"{P}.{i}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
        if kind == "linear_attention":
            a = f"{P}.{i}.linear_attn"
            ignore += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            ignore += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS}}}


def compressed_tensors_nvfp4(dst: Path, base: Path | None = None) -> Path:
    """RedHatAI's compressed-tensors NVFP4 layout over `base` (a widened NVFP4 base, shared
    expert quantized), or, `base` None, over the bundled NVFP4 case's twin with the shared
    expert ignored."""
    if base is not None:
        return write_nvfp4(base, dst, redhat_config())
    base = nvfp4_base(dst.with_name(dst.name + "-base"))
    out = write_nvfp4(base, dst, redhat_config(ignore_shared_expert=True))
    shutil.rmtree(base)
    return out


def with_tensor(folder: Path, dst: Path, name: str, value: float,
                shape: tuple[int, ...] | None = None) -> Path:
    """A copy of checkpoint folder `folder` (one `model.safetensors`) at `dst` with tensor
    `name` set to `value` everywhere: its own shape and dtype when it exists, else a new
    float32 tensor of `shape` (default 0-d), as a producer that stores it would write it."""
    shutil.copytree(folder, dst)
    tensors = load_file(dst / "model.safetensors")
    if name in tensors and shape is None:
        tensors[name] = torch.full_like(tensors[name], value)
    else:
        tensors[name] = torch.full(shape or (), value, dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors")
    return dst


def split_in_two(src: Path, dst: Path) -> Path:
    """A copy of checkpoint folder `src` with its `model.safetensors` split into two files
    and a `model.safetensors.index.json`, the cut inside a quantized module (its scale in the
    second file, its weight in the first)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)  # a module's weight sorts just before its weight_scale
    cut = next(i for i in range(len(names) // 2, len(names))
               if names[i].endswith((".weight_scale", ".weight_scale_inv")))
    assert names[cut - 1].rpartition(".")[0] == names[cut].rpartition(".")[0], names[cut]
    files = {"model-00001-of-00002.safetensors": names[:cut],
             "model-00002-of-00002.safetensors": names[cut:]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, dst / file)
    weight_map = {n: f for f, part in files.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def harness_folders(root: Path) -> dict[str, Path]:
    """The memory and kernels checks' set under `root`, by name: block FP8 on Qwen3.5-MoE
    (`block-fp8`) and Llama (`block-fp8-dense`), ModelOpt mixed with an FP8 shared expert,
    compressed-tensors NVFP4 with the shared expert ignored, ModelOpt FP8 Llama."""
    return {"block-fp8": block_fp8("tiny-qwen3.5-moe", root / "block-fp8"),
            "block-fp8-dense": block_fp8("tiny-llama", root / "block-fp8-dense"),
            "modelopt-mixed": modelopt_mixed(root / "modelopt-mixed"),
            "ct-nvfp4": compressed_tensors_nvfp4(root / "ct-nvfp4"),
            "modelopt-fp8-dense": modelopt_fp8_llama(root / "modelopt-fp8-dense")}


def layout_folders(root: Path) -> dict[str, Path]:
    """The shards check's set under `root`, by name: block FP8 on every bundled decoder,
    ModelOpt FP8 and NVFP4 Llama, and over the widened NVFP4 base ModelOpt mixed (NVFP4
    shared expert) and compressed-tensors NVFP4 (shared expert quantized)."""
    base = nvfp4_base(root / "nvfp4-base", widened=True)
    folders = {f"block-fp8-{name}": block_fp8(case, root / f"block-fp8-{name}")
               for name, case in (("qwen3.5", "tiny-qwen3.5-moe"), ("qwen3", "tiny-qwen3"),
                                  ("qwen3-moe", "tiny-qwen3-moe"), ("llama", "tiny-llama"))}
    folders.update({
        "modelopt-fp8-llama": modelopt_fp8_llama(root / "modelopt-fp8-llama"),
        "modelopt-nvfp4-llama": modelopt_nvfp4_llama(root / "modelopt-nvfp4-llama"),
        "modelopt-mixed": modelopt_mixed(root / "modelopt-mixed", base, NVFP4),
        "ct-nvfp4": compressed_tensors_nvfp4(root / "ct-nvfp4", base)})
    shutil.rmtree(base)
    return folders
