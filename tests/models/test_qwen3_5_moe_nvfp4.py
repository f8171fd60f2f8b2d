"""Qwen3.5-MoE with NVFP4 routed experts, end to end on CPU in fp32.

The bundled case `tiny-qwen3.5-moe-nvfp4` stores its experts in ModelOpt's layout; its
reference is HF on the dequantized experts, so the engine's only error is fp32 reduction
order (observed max abs ~4e-6 to 7e-6 on logits of magnitude ~5 at TP 1, 2, 4, 8). The
compressed-tensors variant holds the same codes and block scales with reciprocal global
scales: it agrees with the ModelOpt checkpoint to fp32 noise, not bitwise (1 / (1 / g) is
g only to within an ulp)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import GOLDEN, case_differences

from freetoken import LLM, SamplingParams
from freetoken.config import ConfigError
from freetoken.formats.quant import parse_quant_config
from freetoken.models.registry import check_tp, config_from_hf, load_config
from freetoken_verify.cases.catalogue import load_reference, write_pinned
from freetoken_verify.cases.nvfp4 import to_compressed_tensors
from freetoken_verify.cli import main

CASE = "tiny-qwen3.5-moe-nvfp4"
FOLDER = GOLDEN / CASE
TP_SIZES = (1, 2, 4, 8)


def _run_verify(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out + err


def _make_folder(tmp_path: Path, **text_changes) -> Path:
    """A copy of the bundled case whose config.json text_config has `text_changes`."""
    folder = tmp_path / "variant"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(text_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _generate(folder: Path, tp: int, prompts) -> list:
    params = SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True,
                            return_prompt_logits=True)
    with LLM(folder, tp=tp, device="cpu", dtype="float32", progress=False) as llm:
        return llm.generate(prompts, params)


def test_verify_passes_at_every_tp_size(capsys, tmp_path):
    """`freetoken-verify` golden, shards and memory pass for the NVFP4 case at TP 1, 2, 4 and
    8 (one rank group per TP size): logits within the fp32 tolerance of HF on the dequantized
    experts, greedy ids equal, every checkpoint tensor on exactly one rule, round trips exact,
    peak memory within budget."""
    report = tmp_path / "report.json"
    code, out = _run_verify(capsys, "--model", CASE, "--tp", ",".join(map(str, TP_SIZES)),
                            "--checks", "golden,shards,memory", "--report-json", str(report))
    assert code == 0, f"freetoken-verify exited {code}:\n{out}"
    results = json.loads(report.read_text())["results"]
    seen = {(r["check"], r["tp"]) for r in results if r["status"] == "pass"}
    want = {(c, tp) for c in ("golden", "shards", "memory") for tp in TP_SIZES}
    assert seen == want, f"passing (check, tp) {sorted(seen)} != {sorted(want)}"
    for r in results:
        if r["check"] == "golden":
            assert r["metrics"]["max_abs"] < 1e-4, f"tp={r['tp']}: {r['metrics']}"


def test_quantized_modules_follow_the_config():
    """The case's hf_quant_config.json makes exactly the routed experts NVFP4 (ModelOpt
    naming); its compressed-tensors twin reads as compressed-tensors with reciprocal globals."""
    cfg = load_config(FOLDER)
    assert cfg.nvfp4_experts and cfg.quantization.producer == "modelopt", cfg.quantization
    assert not cfg.quantization.global_scale_is_reciprocal
    unquantized = load_config(GOLDEN / "tiny-qwen3.5-moe")
    assert unquantized.quantization is None and not unquantized.nvfp4_experts


def test_compressed_tensors_variant_gives_the_modelopt_logits(tmp_path):
    """The compressed-tensors conversion (weight_packed, weight_scale, reciprocal
    weight_global_scale, quantization_config in config.json) loads at TP 2 and gives the
    ModelOpt checkpoint's prompt and decode logits within 1e-5 and the same tokens."""
    ct = to_compressed_tensors(FOLDER, tmp_path / "ct")
    cfg = load_config(ct)
    assert cfg.nvfp4_experts and cfg.quantization.global_scale_is_reciprocal, cfg.quantization
    meta, _ = load_reference(FOLDER)
    prompts = meta["prompts"]
    modelopt, compressed = _generate(FOLDER, 2, prompts), _generate(ct, 2, prompts)
    for i, (a, b) in enumerate(zip(modelopt, compressed)):
        assert a.token_ids == b.token_ids, f"prompt {i}: {a.token_ids} != {b.token_ids}"
        for what in ("prompt_logits", "logits"):
            torch.testing.assert_close(getattr(b, what), getattr(a, what), rtol=1e-5,
                                       atol=1e-5, msg=lambda m, i=i, w=what: f"prompt {i} {w}: {m}")


def test_split_cutting_a_group_is_refused(capsys, tmp_path):
    """moe_intermediate_size=96 splits into 48 per rank at TP 2 but 24 at TP 4, not a whole
    number of 16-element groups: check_tp names the dimension and the group, and
    freetoken-verify exits 2 with that message before any rank starts."""
    folder = _make_folder(tmp_path, moe_intermediate_size=96)
    cfg = load_config(folder)
    check_tp(cfg, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size: 96 .* tp_size=4: 24 per rank"
                                         r" is not a multiple of the 16-element group"):
        check_tp(cfg, 4)
    code, out = _run_verify(capsys, "--model", str(folder), "--tp", "1,4", "--checks", "shards")
    assert code == 2, f"expected exit 2, got {code}:\n{out}"
    assert "moe_intermediate_size" in out and "16-element group" in out, out


def test_quantized_gated_delta_net_is_refused_by_name():
    """A quantization config that leaves linear_attn out of its exclude list (NVFP4 GDN
    projections do not run) is refused naming the first such module (layer 0 is
    GatedDeltaNet)."""
    hf = json.loads((FOLDER / "config.json").read_text())
    raw = json.loads((FOLDER / "hf_quant_config.json").read_text())
    raw["quantization"]["exclude_modules"] = [
        p for p in raw["quantization"]["exclude_modules"] if "linear_attn" not in p]
    with pytest.raises(ConfigError, match=r"model\.language_model\.layers\.0\.linear_attn\."
                                          r"in_proj_qkv is NVFP4"):
        config_from_hf(hf, parse_quant_config(raw))


def test_regeneration_is_deterministic(tmp_path):
    """`python -m freetoken_verify.cases --case tiny-qwen3.5-moe-nvfp4` (pinned numerics, a
    fresh process) writes the committed bytes (with the torch / transformers versions
    meta.json records): weights, quantization config and the reference HF computes on the
    dequantized experts, and baselines within float rounding."""
    meta = json.loads((FOLDER / "meta.json").read_text())
    if (meta["torch"], meta["transformers"]) != (torch.__version__.split("+")[0],
                                                 transformers.__version__):
        pytest.skip("installed torch/transformers differ from the ones golden was written with")
    (written,) = write_pinned([CASE], tmp_path)
    assert case_differences(written, FOLDER) == [], (
        f"golden/{CASE} is not what the case writer produces now")
