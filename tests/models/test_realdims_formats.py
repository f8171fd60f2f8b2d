"""The real-dimension generator's quantized layouts (`freetoken_verify.cases.realdims`), on the
bundled `tiny-qwen3.5-moe` weights instead of the real dimensions (the same writers and
configs, seconds instead of minutes): each family resolves every module to the format its
producer writes, and the engine at TP 1 gives its dequantized twin's outputs."""

from __future__ import annotations

import pytest
from conftest import GOLDEN
from twin_outputs import assert_same_outputs, generate

from freetoken.formats.quant import BF16, FP8_BLOCK, FP8_TENSOR, NVFP4, read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.models.registry import load_config
from freetoken_verify.cases.realdims import quantize_checkpoint

# engine module suffix -> the family's format of it (GDN in_proj: its [qkv | z] GEMM)
EXPECTED = {
    "fp8-block": {"qkv_proj": FP8_BLOCK, "o_proj": FP8_BLOCK, "linear_attn.in_proj": FP8_BLOCK,
                  "out_proj": FP8_BLOCK, "shared_expert.gate_up_proj": FP8_BLOCK,
                  "shared_expert.down_proj": FP8_BLOCK, "mlp.experts": FP8_BLOCK,
                  "lm_head": BF16, "mlp.gate": BF16},
    "nvfp4-ct": {"qkv_proj": NVFP4, "o_proj": NVFP4, "linear_attn.in_proj": BF16,
                 "out_proj": BF16, "shared_expert.gate_up_proj": NVFP4,
                 "shared_expert.down_proj": NVFP4, "mlp.experts": NVFP4, "lm_head": BF16,
                 "mlp.gate": BF16},
    "modelopt-mixed": {"qkv_proj": FP8_TENSOR, "o_proj": FP8_TENSOR,
                       "linear_attn.in_proj": FP8_TENSOR, "out_proj": FP8_TENSOR,
                       "shared_expert.gate_up_proj": NVFP4, "shared_expert.down_proj": NVFP4,
                       "mlp.experts": NVFP4, "lm_head": NVFP4, "mlp.gate": BF16},
}


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_each_family_resolves_and_matches_its_twin(tmp_path, fmt):
    """Every destination of the converted checkpoint has its family's format (the first
    GEMM of GDN in_proj; in_proj_b / in_proj_a stay bf16 in all three), and greedy tokens
    and logits at TP 1 equal the dequantized twin's."""
    folder = quantize_checkpoint(GOLDEN / "tiny-qwen3.5-moe", tmp_path / fmt, fmt,
                                 block=(16, 16))
    formats = load_config(folder).module_formats
    for suffix, kind in EXPECTED[fmt].items():
        names = [n for n in formats if n.endswith(suffix)]
        assert names, f"{fmt}: no module ends with {suffix}"
        wrong = {n: formats[n][0].format.kind for n in names
                 if formats[n][0].format.kind != kind}
        assert not wrong, f"{fmt}: {suffix} should be {kind}, got {wrong}"
        if suffix == "linear_attn.in_proj" and kind != BF16:
            assert all(formats[n][1].format.kind == BF16 for n in names), f"{fmt}: in_proj_ba"
    twin = write_dequantized_twin(folder, tmp_path / "twin", read_quant_config(folder))
    assert_same_outputs(generate(folder, 1), generate(twin, 1), fmt)
