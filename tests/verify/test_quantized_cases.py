"""The quantized bundled cases (`tiny-qwen3.5-moe-nvfp4-ct`, `tiny-qwen3.5-moe-mixed`,
`tiny-qwen3.5-moe-fp8`, `tiny-qwen3-fp8`): every linear module is stored in, and resolves to,
the format its release gives it (stated here from the releases, independently of the
writers); their dimensions make each TP constraint bite; meta.json says the quantization and
hashes the quantized weights; the stored golden is HF on the dequantized twin (and not on
the unquantized weights); `make golden` writes the committed bytes; shards and memory read
every one of their formats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from cli_run import run_cli
from conftest import GOLDEN, case_differences
from safetensors.torch import load_file

from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.models.registry import check_tp, load_config
from freetoken_verify.cases.catalogue import (
    CASES,
    build_hf_model,
    load_reference,
    sha256_file,
    write_pinned,
)

NEW_CASES = ("tiny-qwen3.5-moe-nvfp4-ct", "tiny-qwen3.5-moe-mixed", "tiny-qwen3.5-moe-fp8",
             "tiny-qwen3-fp8")
L = r"model\.language_model\.layers\.\d+"
ATTENTION = rf"{L}\.self_attn\.[qkvo]_proj"
GDN_QKV_Z_OUT = rf"{L}\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
GDN_B_A = rf"{L}\.linear_attn\.in_proj_[ba]"
SHARED = rf"{L}\.mlp\.shared_expert\.(gate|up|down)_proj"
EXPERTS = rf"{L}\.mlp\.experts\.\d+\.(gate|up|down)_proj"
ROUTERS = rf"{L}\.mlp\.(gate|shared_expert_gate)"
INTENT = {
    # RedHatAI's recipe: every Linear but linear_attn, routers, shared_expert_gate, lm_head.
    "tiny-qwen3.5-moe-nvfp4-ct": [(ATTENTION, "nvfp4"), (SHARED, "nvfp4"), (EXPERTS, "nvfp4"),
                                  (rf"{L}\.linear_attn\.\w+", "bf16"), (ROUTERS, "bf16"),
                                  ("lm_head", "bf16")],
    # NVIDIA's Qwen3.6 recipe: W4A16 NVFP4 MLPs and lm_head, FP8 attention and GDN qkv/z/out.
    "tiny-qwen3.5-moe-mixed": [(EXPERTS, "nvfp4"), (SHARED, "nvfp4"), ("lm_head", "nvfp4"),
                               (ATTENTION, "fp8-tensor"), (GDN_QKV_Z_OUT, "fp8-tensor"),
                               (GDN_B_A, "bf16"), (ROUTERS, "bf16")],
    # Qwen's FP8 releases: attention, GDN qkv/z/out, shared expert, every expert.
    "tiny-qwen3.5-moe-fp8": [(ATTENTION, "fp8-block"), (GDN_QKV_Z_OUT, "fp8-block"),
                             (SHARED, "fp8-block"), (EXPERTS, "fp8-block"), (GDN_B_A, "bf16"),
                             (ROUTERS, "bf16"), ("lm_head", "bf16")],
    "tiny-qwen3-fp8": [(r"model\.layers\.\d+\.self_attn\.[qkvo]_proj", "fp8-block"),
                       (r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj", "fp8-block"),
                       ("lm_head", "bf16")],
}


def _intended(case: str, module: str) -> str:
    for pattern, kind in INTENT[case]:
        if re.fullmatch(pattern, module):
            return kind
    raise AssertionError(f"{case}: no intended format for {module}")


def _stored(folder: Path) -> dict[str, str]:
    """Every text-model linear module of the checkpoint -> the format its tensors are in:
    a packed uint8 weight is NVFP4, an e4m3 weight with `weight_scale_inv` block FP8, with a
    one-element `weight_scale` FP8 per tensor, a float weight bf16 (unquantized)."""
    tensors = load_file(folder / "model.safetensors")
    found = {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "weight_packed") or t.dim() != 2 or \
                module.startswith("model.visual") or module.endswith("embed_tokens"):
            continue
        if t.dtype == torch.uint8:
            found[module] = "nvfp4"
        elif t.dtype == torch.float8_e4m3fn:
            block = f"{module}.weight_scale_inv" in tensors
            assert block or tensors[f"{module}.weight_scale"].numel() == 1, module
            found[module] = "fp8-block" if block else "fp8-tensor"
        else:
            found[module] = "bf16"
    return found


@pytest.mark.parametrize("case", NEW_CASES)
def test_every_module_is_stored_in_and_resolves_to_its_intended_format(case):
    """Each linear module's tensors are in the format its release gives it, the case's
    quantization config makes it that format, and every engine destination (fused q|k|v,
    gate|up, GDN in_proj split into [qkv | z] and [b | a], stacked experts) computes each of
    its parts in that format."""
    folder = GOLDEN / case
    stored, cfg = _stored(folder), load_config(folder)
    scheme = cfg.quantization
    assert scheme is not None and scheme.producer == CASES[case].recipe.producer, scheme
    for module, kind in stored.items():
        want = _intended(case, module)
        assert kind == want, f"{case}: {module} is stored as {kind}, its release has {want}"
        got = scheme.format_of(module).kind
        assert got == want, f"{case}: the config makes {module} {got}, not {want}"
    if "lm_head" not in stored:  # tied to the embedding
        assert scheme.format_of("lm_head").kind == "bf16"
    covered = set()
    for dest, gemms in cfg.module_formats.items():
        for gemm in gemms:
            for part in gemm.parts:
                if part in stored:
                    covered.add(part)
                    assert gemm.format.kind == _intended(case, part), (dest, part, gemm)
    assert covered == set(stored), f"{case}: modules no destination takes: " \
                                   f"{sorted(set(stored) - covered)[:5]}"


def test_the_configs_are_written_as_the_releases_write_them():
    """compressed-tensors: an expanded ignore list of split names naming linear_attn itself,
    its conv1d and norm; ModelOpt: MIXED_PRECISION with the routed experts keyed by their
    `mlp.experts` container and no exclude list; HF fp8: 24 x 40 blocks, bf16
    weight_scale_inv, modules_to_not_convert expanded per module."""
    ct = json.loads((GOLDEN / "tiny-qwen3.5-moe-nvfp4-ct" / "config.json").read_text())
    q = ct["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    gdn = "model.language_model.layers.0.linear_attn"
    for entry in (gdn, f"{gdn}.conv1d", f"{gdn}.norm", f"{gdn}.in_proj_b", f"{gdn}.in_proj_a",
                  "model.language_model.layers.1.mlp.shared_expert_gate", "lm_head"):
        assert entry in q["ignore"], entry
    assert not any(e.startswith("re:") for e in q["ignore"]), q["ignore"]
    mixed = json.loads((GOLDEN / "tiny-qwen3.5-moe-mixed" / "hf_quant_config.json").read_text())
    m = mixed["quantization"]
    assert m["quant_algo"] == "MIXED_PRECISION" and "exclude_modules" not in m, m
    layers = m["quantized_layers"]
    assert layers["model.language_model.layers.0.mlp.experts"]["quant_algo"] == "W4A16_NVFP4"
    assert not any(".experts." in k for k in layers), "experts keyed one by one"
    assert "quantization_config" not in json.loads(
        (GOLDEN / "tiny-qwen3.5-moe-mixed" / "config.json").read_text())
    for case in ("tiny-qwen3.5-moe-fp8", "tiny-qwen3-fp8"):
        q = json.loads((GOLDEN / case / "config.json").read_text())["quantization_config"]
        assert (q["quant_method"], q["weight_block_size"]) == ("fp8", [24, 40]), q
        assert "lm_head" in q["modules_to_not_convert"]
        scales = [t for n, t in load_file(GOLDEN / case / "model.safetensors").items()
                  if n.endswith("weight_scale_inv")]
        assert scales and all(t.dtype == torch.bfloat16 for t in scales), case


def _scalar(tensors: dict, name: str) -> float:
    return float(tensors[name].reshape(()))


def test_fused_parts_carry_their_own_scales():
    """Every part of a fused destination has its own global / per-tensor scale, unequal to
    its neighbours' (producers often make them equal; an engine reading one segment's scale
    for all would pass on such a case): q / k / v, shared-expert gate / up and expert gate /
    up NVFP4 globals; q / k / v and in_proj_qkv / in_proj_z FP8 weight and input scales."""
    p = "model.language_model.layers"
    ct = load_file(GOLDEN / "tiny-qwen3.5-moe-nvfp4-ct" / "model.safetensors")
    mixed = load_file(GOLDEN / "tiny-qwen3.5-moe-mixed" / "model.safetensors")
    groups = [
        (ct, [f"{p}.1.self_attn.{x}_proj.weight_global_scale" for x in "qkv"]),
        (ct, [f"{p}.0.mlp.shared_expert.{x}_proj.weight_global_scale" for x in ("gate", "up")]),
        (ct, [f"{p}.1.self_attn.{x}_proj.input_global_scale" for x in "qkv"]),
        (mixed, [f"{p}.0.mlp.experts.3.{x}_proj.weight_scale_2" for x in ("gate", "up")]),
        (mixed, [f"{p}.1.self_attn.{x}_proj.weight_scale" for x in "qkv"]),
        (mixed, [f"{p}.1.self_attn.{x}_proj.input_scale" for x in "qkv"]),
        (mixed, [f"{p}.0.linear_attn.in_proj_{x}.weight_scale" for x in ("qkv", "z")]),
    ]
    for tensors, names in groups:
        values = [_scalar(tensors, n) for n in names]
        assert len(set(values)) == len(values), dict(zip(names, values))
    assert not any(n.endswith("input_scale") and "mlp" in n for n in mixed), \
        "W4A16 NVFP4 modules have no input quantizer"


@pytest.mark.parametrize("case", NEW_CASES)
def test_dimensions_make_every_constraint_bite(case):
    """Valid at TP 1, 2, 4 and 8; 2 KV heads (replicated at TP 4 and 8); vocab 301 (padded
    rows at every TP > 1, NVFP4 lm_head rows included in the mixed case); NVFP4 inputs split
    on whole 16-element groups at TP 8 (128-wide experts and shared expert: 16 per rank);
    block FP8 with partial last blocks and, at TP 8, ranks whose rows or inputs start inside
    a block a neighbour also holds."""
    cfg = load_config(GOLDEN / case)
    for tp in (1, 2, 4, 8):
        check_tp(cfg, tp)
    assert (cfg.num_key_value_heads, cfg.vocab_size) == (2, 301), cfg
    tensors = load_file(GOLDEN / case / "model.safetensors")
    kinds = set(_stored(GOLDEN / case).values())
    if "nvfp4" in kinds:
        assert cfg.moe_intermediate_size // 8 == 16, cfg.moe_intermediate_size
    if case in ("tiny-qwen3.5-moe-nvfp4-ct", "tiny-qwen3.5-moe-mixed"):
        assert cfg.shared_expert_intermediate_size // 8 == 16
    if case == "tiny-qwen3.5-moe-mixed":
        assert tensors["lm_head.weight"].dtype == torch.uint8
        assert tuple(tensors["lm_head.weight"].shape) == (301, 32)
    if "fp8-block" in kinds:
        rows, inputs = 24, 40
        shapes = [tuple(tensors[n.replace("_scale_inv", "")].shape) for n in tensors
                  if n.endswith("weight_scale_inv")]
        assert any(o % rows for o, _ in shapes) and any(i % inputs for _, i in shapes), shapes
        assert any((o // 8) % rows for o, _ in shapes), "no rank at TP 8 starts mid-block"


@pytest.mark.parametrize("case", NEW_CASES)
def test_meta_says_the_quantization_and_hashes_the_quantized_weights(case):
    """meta.json names the producer, the layout it copies, the formats by module and the
    reference (HF on the dequantized twin); `weights_sha256` is the hash of the quantized
    model.safetensors."""
    meta = json.loads((GOLDEN / case / "meta.json").read_text())
    quant = meta["quantization"]
    assert quant["producer"] == CASES[case].recipe.producer, quant
    assert "dequantized twin" in quant["reference"], quant
    kinds = set(_stored(GOLDEN / case).values()) - {"bf16"}
    assert kinds == set(quant["formats"]) - {"bf16"}, quant["formats"]
    assert set(meta["weights_sha256"]) == {"model.safetensors"}, meta["weights_sha256"]
    digest = sha256_file(GOLDEN / case / "model.safetensors")
    assert meta["weights_sha256"]["model.safetensors"] == digest, f"{case}: sha256 changed"


def _hf_logits(model_or_folder, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model_or_folder
    if isinstance(model_or_folder, Path):
        model = AutoModelForCausalLM.from_pretrained(model_or_folder, dtype=torch.float32)
    with torch.inference_mode():
        return model.eval()(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("case", NEW_CASES)
def test_golden_is_hf_on_the_dequantized_twin(case, tmp_path):
    """HF in float32 on the twin rebuilt now from the committed quantized files gives the
    stored prefill logits of the 23-token prompt (float32 rounding only), and HF on the
    unquantized weights the case was quantized from does not (the quantization error is
    there: a golden written from the wrong weights fails this)."""
    folder = GOLDEN / case
    meta, stored = load_reference(folder)
    twin = write_dequantized_twin(folder, tmp_path / "twin", read_quant_config(folder))
    prompt = meta["prompts"][1]
    want = stored["prefill_logits_1"]
    torch.testing.assert_close(_hf_logits(twin, prompt), want, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{case}: HF on the twin: {m}")
    spec = CASES[case]
    unquantized = _hf_logits(build_hf_model(spec, eos=0), prompt)
    gap = float((unquantized - want).abs().max())
    assert gap > 1e-2, f"{case}: the unquantized model is within {gap} of the golden"


def test_regeneration_is_deterministic(tmp_path):
    """`python -m freetoken_verify.cases` (pinned numerics, a fresh process) writes the
    committed quantized cases (with the torch / transformers versions meta.json records):
    quantized weights and configs the same bytes, the twin's reference logits and the bf16 /
    fp16 baselines within `case_differences`' float rounding."""
    meta = json.loads((GOLDEN / NEW_CASES[0] / "meta.json").read_text())
    if (meta["torch"], meta["transformers"]) != (torch.__version__.split("+")[0],
                                                 transformers.__version__):
        pytest.skip("installed torch/transformers differ from the ones golden was written with")
    written = write_pinned(list(NEW_CASES), tmp_path)
    for folder in written:
        assert case_differences(folder, GOLDEN / folder.name) == [], (
            f"golden/{folder.name} is not what the case writer produces now")


def test_shards_and_memory_pass_on_every_quantized_case(capsys, tmp_path):
    """shards states every tensor of the four layouts (block-FP8 `weight_scale_inv`, per-tensor
    FP8 scales, dense NVFP4 linears, the split GDN `in_proj_ba`) and memory counts their bytes
    by format: both pass at TP 1, 2 and 8 (ranks sharing blocks, NVFP4 groups of 16 per rank)."""
    report = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "--model", ",".join(NEW_CASES), "--tp", "1,2,8",
                             "--checks", "memory,shards", "--report-json", str(report))
    rows = json.loads(report.read_text())["results"]
    assert code == 0 and len(rows) == 4 * 3 * 2, out + err
    assert {r["status"] for r in rows} == {"pass"}, out
