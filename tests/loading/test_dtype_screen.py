"""The dtype screen: a float8 or uint8 tensor in a module the quantization config does not
declare quantized is refused before anything loads, naming the tensor and its dtype, by the
header screen (`freetoken.loading.screen`, run by `LLM` before any rank starts) and again by
the loader on each rank (a quantized dtype never casts into an unquantized parameter). The
raw-float8 checkpoint: every linear weight of a bundled case cast to e4m3 with its
quantization config and scales lost, which otherwise loads and generates garbage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken import LLM
from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.quant import parse_quant_config
from freetoken.loading import CheckpointError, CheckpointReader, load_weights
from freetoken.loading.loader import LoadError
from freetoken.loading.screen import screen, screen_checkpoint
from freetoken.models.registry import build_model, load_config, shard_plan

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _make_raw_float8(tmp_path: Path, case: str = "tiny-llama") -> Path:
    """The bundled case with every linear weight stored as float8_e4m3fn, no scales and no
    quantization config (what a float8 checkpoint that lost its config looks like)."""
    folder = tmp_path / f"{case}-raw-fp8"
    shutil.copytree(GOLDEN / case, folder)
    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if name.rpartition(".")[0].rpartition(".")[2] in LINEAR:
            tensors[name] = t.clamp(-448, 448).to(torch.float8_e4m3fn)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _assert_names(error: Exception, *words: str) -> None:
    message = str(error)
    missing = [w for w in words if w not in message]
    assert not missing, f"message lacks {missing}: {message}"


def test_raw_float8_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    """`LLM` on the raw-float8 checkpoint raises CheckpointError naming the first float8
    tensor, its dtype and that no quantization config declares it."""
    folder = _make_raw_float8(tmp_path)
    with pytest.raises(CheckpointError) as info:
        LLM(folder, tp=1, device="cpu", dtype="float32", progress=False)
    _assert_names(info.value, "model.layers.0.mlp.down_proj.weight", "float8_e4m3fn",
                  "no quantization config")


def test_loader_refuses_a_float8_tensor_into_an_unquantized_parameter(tmp_path):
    """Loading the raw-float8 checkpoint straight through the loader (a rank that skipped the
    header screen) is a LoadError naming the tensor, its dtype and the parameter, raised
    while planning, before the first copy."""
    folder = _make_raw_float8(tmp_path)
    cfg = load_config(folder)
    set_tp_info(TPInfo(0, 2))
    try:
        model = build_model(cfg)
        with pytest.raises(LoadError) as info:
            load_weights(model, CheckpointReader(folder), shard_plan(cfg, 2), progress=False)
    finally:
        reset_tp_info()
    _assert_names(info.value, "float8_e4m3fn", "quantized data", "does not declare")


def test_screen_follows_the_config_not_the_dtype():
    """A tensor passes where the config puts its module in a quantized format that writes
    that tensor name (FP8 block `weight` and `weight_scale_inv`; NVFP4 `weight` uint8), and is
    refused where the module is excluded, or under a name its format does not write (a
    `weight_scale` where HF fp8 writes `weight_scale_inv`); bf16 tensors and the vision
    tower are never screened."""
    fp8 = parse_quant_config({"quant_method": "fp8", "weight_block_size": [16, 16],
                              "modules_to_not_convert": ["lm_head"]}, "config.json")
    ok = {Q_PROJ: "F8_E4M3", Q_PROJ + "_scale_inv": "BF16", "lm_head.weight": "BF16",
          "model.visual.blocks.0.weight": "F8_E4M3"}
    screen(ok, fp8)
    for bad, label in (({"lm_head.weight": "F8_E4M3"}, "lm_head.weight"),
                       ({"model.layers.0.self_attn.q_proj.weight_scale": "F8_E4M3"},
                        "q_proj.weight_scale")):
        with pytest.raises(CheckpointError) as info:
            screen({**ok, **bad}, fp8)
        _assert_names(info.value, label, "float8_e4m3fn", "config.json")
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate.weight' is uint8"):
        screen({"model.layers.0.mlp.gate.weight": "U8"}, None)


def test_bundled_nvfp4_case_passes_the_screen():
    """The bundled NVFP4 case (uint8 / e4m3 expert tensors declared by its config) passes."""
    folder = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
    screen_checkpoint(folder, load_config(folder).quantization)
