"""Checkpoints for `bench/load.py`, written with safetensors directly (no model is built), in
several files with a `model.safetensors.index.json`, as real checkpoints are:

* `llama`: hidden 2048, intermediate 5632, 16 heads, 4 KV heads, vocab 32000, untied head,
  `layers` decoder layers (2.17 GiB at 10 layers in fp32);
* `qwen35-bf16` / `qwen35-nvfp4`: Qwen3.6-35B-A3B's text dimensions (`REAL_TEXT` of
  `freetoken_verify/cases/qwen3_5_moe.py`: hidden 2048, vocab 248320, 256 experts of 512,
  GatedDeltaNet 16 key / 32 value heads of 128, 16 q / 2 KV heads of 256) in its multimodal on-disk
  layout, with `layers` layers alternating GatedDeltaNet and full attention; experts in bf16 (about
  5.4 GB at 2 layers) or NVFP4 in the ModelOpt layout (about 3 GB).

Tensor contents are tiled from a 64 MiB pool of random values per dtype (fast to write; load
speed does not depend on the values)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TENSORS_PER_FILE_BYTES = 1 << 30
POOL_BYTES = 64 << 20
MIB = 2**20
SEED = 0

LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, vocab_size=32000)
CASES = ("llama", "qwen35-bf16", "qwen35-nvfp4")


def llama_files(layers: int) -> list[dict]:
    """Two decoder layers per file, embeddings and head last (as `llama_shapes` orders them)."""
    shapes, files = llama_shapes(layers), []
    for first in range(0, layers, 2):
        prefixes = tuple(f"model.layers.{n}." for n in range(first, min(first + 2, layers)))
        files.append({k: v for k, v in shapes.items() if k.startswith(prefixes)})
    files.append({k: v for k, v in shapes.items() if not k.startswith("model.layers.")})
    return files


def llama_shapes(layers: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    h, i, hd = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["head_dim"]
    q, kv, v = LLAMA["num_attention_heads"] * hd, LLAMA["num_key_value_heads"] * hd, \
        LLAMA["vocab_size"]
    shapes = {}
    for n in range(layers):
        p = f"model.layers.{n}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
            f"{p}.mlp.down_proj.weight": (h, i)})
    shapes.update({"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                   "model.norm.weight": (h,)})
    return {k: (s, None) for k, s in shapes.items()}


def llama_config(layers: int, dtype: str) -> dict:
    return dict(LLAMA, architectures=["LlamaForCausalLM"], model_type="llama",
                num_hidden_layers=layers, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=2048, tie_word_embeddings=False, dtype=dtype,
                eos_token_id=2)


def _real_text() -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from freetoken_verify.cases.qwen3_5_moe import REAL_TEXT

    return dict(REAL_TEXT)


def _expert_shapes(p: str, t: dict, nvfp4: bool) -> dict:
    h, i = t["hidden_size"], t["moe_intermediate_size"]
    shapes = {}
    for e in range(t["num_experts"]):
        x = f"{p}.mlp.experts.{e}"
        for proj, (rows, cols) in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                   ("down_proj", (h, i))):
            if not nvfp4:
                shapes[f"{x}.{proj}.weight"] = ((rows, cols), None)
                continue
            shapes.update({f"{x}.{proj}.weight": ((rows, cols // 2), torch.uint8),
                           f"{x}.{proj}.weight_scale": ((rows, cols // 16), torch.float8_e4m3fn),
                           f"{x}.{proj}.weight_scale_2": ((), torch.float32),
                           f"{x}.{proj}.input_scale": ((), torch.float32)})
    return shapes


def qwen35_shapes(layers: int, nvfp4: bool) -> dict:
    t = _real_text()
    h, v = t["hidden_size"], t["vocab_size"]
    hd, heads, kv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, s = t["linear_key_head_dim"], t["linear_value_head_dim"], \
        t["shared_expert_intermediate_size"]
    root = "model.language_model"
    shapes: dict = {}
    for n in range(layers):
        p = f"{root}.layers.{n}"
        if n % 2 == 0:
            a = f"{p}.linear_attn"
            conv = 2 * nk * dk + nv * dv
            shapes.update({f"{a}.in_proj_qkv.weight": (conv, h), f"{a}.in_proj_z.weight":
                           (nv * dv, h), f"{a}.in_proj_b.weight": (nv, h),
                           f"{a}.in_proj_a.weight": (nv, h), f"{a}.conv1d.weight": (conv, 1, 4),
                           f"{a}.A_log": (nv,), f"{a}.dt_bias": (nv,), f"{a}.norm.weight": (dv,),
                           f"{a}.out_proj.weight": (h, nv * dv)})
        else:
            a = f"{p}.self_attn"
            shapes.update({f"{a}.q_proj.weight": (2 * heads * hd, h),
                           f"{a}.k_proj.weight": (kv * hd, h), f"{a}.v_proj.weight": (kv * hd, h),
                           f"{a}.o_proj.weight": (h, heads * hd), f"{a}.q_norm.weight": (hd,),
                           f"{a}.k_norm.weight": (hd,)})
        shapes.update({f"{p}.input_layernorm.weight": (h,),
                       f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.mlp.gate.weight": (t["num_experts"], h),
                       f"{p}.mlp.shared_expert_gate.weight": (1, h),
                       f"{p}.mlp.shared_expert.gate_proj.weight": (s, h),
                       f"{p}.mlp.shared_expert.up_proj.weight": (s, h),
                       f"{p}.mlp.shared_expert.down_proj.weight": (h, s)})
    shapes.update({f"{root}.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                   f"{root}.norm.weight": (h,)})
    out = {k: (shape, None) for k, shape in shapes.items()}
    for n in range(layers):
        out.update(_expert_shapes(f"{root}.layers.{n}", t, nvfp4))
    return out


def qwen35_config(layers: int, dtype: str) -> dict:
    t = _real_text()
    t.update(num_hidden_layers=layers, eos_token_id=0,
             layer_types=["linear_attention" if n % 2 == 0 else "full_attention"
                          for n in range(layers)])
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "dtype": dtype, "tie_word_embeddings": False, "text_config": t}


HF_QUANT = {"producer": {"name": "modelopt", "version": "0.35.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                             "group_size": 16, "exclude_modules": [
                                 "lm_head", "model.visual*", "mtp*",
                                 "model.language_model.layers.*.self_attn*",
                                 "model.language_model.layers.*.linear_attn*",
                                 "model.language_model.layers.*.mlp.gate",
                                 "model.language_model.layers.*.mlp.shared_expert*"]}}


def _pool(dtype: torch.dtype) -> torch.Tensor:
    """POOL_BYTES of valid `dtype` values (random normal x 0.02; random bytes for uint8)."""
    gen = torch.Generator().manual_seed(SEED)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=gen)
    values = torch.randn(POOL_BYTES // dtype.itemsize, generator=gen) * 0.02
    return values.to(dtype).view(torch.uint8)


def _tensor(shape: tuple, dtype: torch.dtype, pools: dict) -> torch.Tensor:
    """A tensor of `shape` tiled with pool bytes of its dtype (global scales: 0.5)."""
    if dtype == torch.float32 and not shape:
        return torch.tensor(0.5)
    if dtype not in pools:
        pools[dtype] = _pool(dtype)
    pool = pools[dtype]
    out = torch.empty(shape, dtype=dtype)
    flat = out.reshape(-1).view(torch.uint8)
    for start in range(0, len(flat), len(pool)):
        part = flat[start:start + len(pool)]
        part.copy_(pool[:len(part)])
    return out


def _by_size(shapes: dict, dtype: torch.dtype) -> list[dict]:
    """Consecutive tensors in files of about TENSORS_PER_FILE_BYTES."""
    files, current, size = [], {}, 0
    for key, (shape, kind) in shapes.items():
        current[key] = (shape, kind)
        size += torch.Size(shape).numel() * (kind or dtype).itemsize
        if size >= TENSORS_PER_FILE_BYTES:
            files.append(current)
            current, size = {}, 0
    return files + ([current] if current else [])


def write(folder: Path, case: str, layers: int, dtype: torch.dtype) -> int:
    """Write checkpoint `case` into `folder`; returns its tensor bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    name = str(dtype).removeprefix("torch.")
    if case == "llama":
        files, config = llama_files(layers), llama_config(layers, name)
    else:
        nvfp4 = case.endswith("nvfp4")
        files, config = _by_size(qwen35_shapes(layers, nvfp4), dtype), qwen35_config(layers, name)
        if nvfp4:
            (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT, indent=1))
    pools: dict = {}
    weight_map, total = {}, 0
    for n, group in enumerate(files, 1):
        file = f"model-{n:05d}-of-{len(files):05d}.safetensors"
        tensors = {k: _tensor(s, d or dtype, pools) for k, (s, d) in group.items()}
        total += sum(t.nbytes for t in tensors.values())
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return total


def warm_page_cache(folder: Path) -> int:
    """Read every weight file once so no mode pays the first read from disk."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            while chunk := f.read(64 * MIB):
                total += len(chunk)
    return total
