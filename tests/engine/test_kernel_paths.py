"""The engine's Triton paths (the ones CUDA takes: paged attention, grouped MoE, device-side
layout and state slots) run end to end in Triton's interpreter on CPU, float32: prompt logits
and greedy tokens of every bundled case equal the torch path's within fp32 rounding, at TP 1
and at a TP 2 rank layout (gloo ranks on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GOLDEN, record_modules
from kernels.interpreted import require_interpreter

from freetoken import LLM, SamplingParams
from freetoken.distributed import get_tp_info

CASES = ["tiny-llama", "tiny-qwen3-moe", "tiny-qwen3.5-moe"]
NEW_TOKENS = 6


def _use_kernels(core, on: bool) -> None:
    # On a GPU machine, a worker that already ran compiled kernels skips, saying why.
    require_interpreter()
    core.use_kernels = on


def _outputs(core, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, return_prompt_logits=True,
                            return_logits=True)
    results = core.generate(prompts, [params] * len(prompts))
    return results if get_tp_info().is_first else None


def _both(core, prompts):
    _use_kernels(core, False)
    want = _outputs(core, prompts)
    _use_kernels(core, True)
    return want, _outputs(core, prompts)


def _assert_same(want, got, label):
    for i, (w, g) in enumerate(zip(want, got)):
        for name in ("prompt_logits", "logits"):
            where = f"{label} prompt {i} {name}"
            torch.testing.assert_close(getattr(g, name), getattr(w, name), rtol=1e-4,
                                       atol=1e-4, msg=lambda m, where=where: f"{where}: {m}")
        assert g.token_ids == w.token_ids, f"{label} prompt {i}: {g.token_ids} != {w.token_ids}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_kernel_path_matches_torch_path(case, tp):
    """Several prompts of different lengths prefill in one step and decode together, so the
    kernels see several sequences, GQA groups and cached offsets at once."""
    prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
    with LLM(GOLDEN / case, tp=tp, device="cpu", dtype="float32", progress=False,
             enforce_eager=True) as llm:
        want, got = llm.run_on_ranks(_both, prompts)[0]
    _assert_same(want, got, f"{case} tp={tp}")


def test_equal_length_prompts_prefill_together():
    """Fresh prompts of one length take the batched GatedDeltaNet prefill on the CUDA path:
    the same logits and tokens as the per-sequence torch path."""
    prompts = json.loads((GOLDEN / "tiny-qwen3.5-moe" / "meta.json").read_text())["prompts"]
    shortest = min(len(p) for p in prompts)
    with LLM(GOLDEN / "tiny-qwen3.5-moe", device="cpu", dtype="float32", progress=False,
             enforce_eager=True) as llm:
        want, got = llm.run_on_ranks(_both, [p[:shortest] for p in prompts])[0]
    _assert_same(want, got, "tiny-qwen3.5-moe equal lengths")


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3.5-moe"])
def test_attention_outputs_are_recorded_on_the_kernel_path(case):
    """The bisect's forward hooks see every attention layer's output on the kernel path too
    (the Triton launches run inside `PagedAttention.forward`), at prefill and at decode, and
    those outputs equal the torch path's."""
    from freetoken.config import EngineConfig
    from freetoken.engine.core import EngineCore
    from freetoken.models.registry import load_config

    folder = GOLDEN / case
    prompt = json.loads((folder / "meta.json").read_text())["prompts"][0]
    core = EngineCore(folder, load_config(folder),
                      EngineConfig(dtype="float32", progress=False, max_num_seqs=1,
                                   enforce_eager=True), torch.device("cpu"))
    attention = {name for name, m in core.model.named_modules()
                 if type(m).__name__ == "PagedAttention"}
    recorded = {}
    for kernels in (False, True):
        _use_kernels(core, kernels)
        recorded[kernels] = {key: c.tensor for key, c in record_modules(core, prompt, 2).items()
                             if key.split("/", 1)[1].split("#")[0] in attention}
    assert attention and len(recorded[True]) == 2 * len(attention), sorted(recorded[True])
    assert recorded[True].keys() == recorded[False].keys()
    for key, want in recorded[False].items():
        torch.testing.assert_close(recorded[True][key], want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _one_token_steps(core, prompt, quant_kernels=False):
    """`_both` on one prompt, and what the MoE blocks of the kernel path fused: how many
    expert down launches added the shared expert and how many the residual
    (`moe_rows.down`), how many router launches stored the normalised input
    (`gemv.linear(normed=)`), how many quantized projections took the norm, the gate or
    the residual (per format), the full-attention layers, and the model's MoE layers.
    `quant_kernels`: the quantized layers take their Triton kernels on CPU too (they serve
    CUDA tensors only), so that the interpreter runs the quantized CUDA path."""
    import inspect

    from freetoken.kernels import fused_moe, gemv, moe_rows, quant_gemm

    assert fused_moe.SHARED_IN_ROWS, "the shared expert in the row kernels is the default"
    originals = moe_rows.down, gemv.linear, quant_gemm.serves, quant_gemm.choose_tiles, \
        quant_gemm.fp8_gemm, gemv.moe_combine, quant_gemm.nvfp4_gemm
    counts = {"shared": 0, "residual": 0, "normed": 0, "fp8 norm": 0, "fp8 residual": 0,
              "fp8 gated": 0, "nvfp4 norm": 0, "nvfp4 residual": 0, "nvfp4 gated": 0,
              "combine": 0, "combine residual": 0}
    if quant_kernels:
        # One-token FP8 and NVFP4 calls take the row kernel, as the GPU's tile table has
        # them.
        def rows_at_one_token(tokens, rows, in_features, fmt):
            if tokens == 1:
                return quant_gemm.QuantTiles(1, 32, 64, rows=True)
            return originals[3](tokens, rows, in_features, fmt)

        def counting(fmt, gemm):
            def call(*args, **kwargs):
                counts[f"{fmt} norm"] += kwargs.get("norm") is not None
                counts[f"{fmt} residual"] += kwargs.get("residual") is not None
                counts[f"{fmt} gated"] += kwargs.get("gated", False)
                return gemm(*args, **kwargs)
            return call

        quant_gemm.serves = lambda x: x.dtype in (torch.bfloat16, torch.float32)
        quant_gemm.choose_tiles = rows_at_one_token
        quant_gemm.fp8_gemm = counting("fp8", originals[4])
        quant_gemm.nvfp4_gemm = counting("nvfp4", originals[6])
    down_args = inspect.signature(moe_rows.down)

    def down(*args, **kwargs):
        given = down_args.bind(*args, **kwargs).arguments
        counts["shared"] += given["hidden_rows"].shared is not None
        counts["residual"] += given.get("residual") is not None
        return originals[0](*args, **kwargs)

    def linear(*args, **kwargs):
        counts["normed"] += kwargs.get("normed") is not None
        return originals[1](*args, **kwargs)

    def combine(*args, **kwargs):
        counts["combine"] += 1
        counts["combine residual"] += kwargs.get("residual") is not None
        return originals[5](*args, **kwargs)

    moe_rows.down, gemv.linear, gemv.moe_combine = down, linear, combine
    try:
        want, got = _both(core, [prompt])
    finally:
        (moe_rows.down, gemv.linear, quant_gemm.serves, quant_gemm.choose_tiles,
         quant_gemm.fp8_gemm, gemv.moe_combine, quant_gemm.nvfp4_gemm) = originals
    cfg = core.model_config
    counts["attention layers"] = list(cfg.layer_types).count("full_attention")
    return want, got, counts, sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))


@pytest.mark.parametrize("case", ["tiny-qwen3.5-moe", "tiny-qwen3.5-moe-fp8",
                                  "tiny-qwen3.5-moe-nvfp4", "tiny-qwen3.5-moe-nvfp4-ct"])
@pytest.mark.parametrize("tp", [1, 2])
def test_one_token_decode_takes_the_shared_expert_in_the_row_kernels(tp, case):
    """One sequence decodes a token per step, so every Qwen3.5 MoE block adds its shared
    expert and gate inside the routed row kernels (the shared intermediate 48 / tp beside
    the routed 32 / tp) and, at TP 1, the decoder layer's residual in their down launch;
    its router normalises the input and stores it for the experts at every step (the
    5-token prefill is a decode-sized batch too, whose slots and shared expert one launch
    combines): the same logits and tokens as the torch path. Block FP8 (24 x 40 blocks,
    the shared expert's rank 1 starting 24 inputs into its column block at TP 2) takes
    the same launches, each block-FP8 operand with its own scales, and its mixers' FP8
    projections take the input norm and the residual add. NVFP4 experts keep their own
    launches; their router still normalises the input, and at TP 1 the launch that combines
    their sum with the gated shared expert adds the residual. compressed-tensors NVFP4 (attention
    quantized, GatedDeltaNet 16-bit): each attention layer's NVFP4 qkv takes the input norm
    and its o_proj the residual on the NVFP4 row kernel, and each MoE layer's NVFP4 shared
    gate_up its SiLU-and-mul."""
    folder = GOLDEN / case
    prompt = json.loads((folder / "meta.json").read_text())["prompts"][0]
    assert len(prompt) <= 16
    with LLM(folder, tp=tp, device="cpu", dtype="float32", progress=False,
             enforce_eager=True) as llm:
        want, got, counts, layers = llm.run_on_ranks(_one_token_steps, prompt,
                                                     case.endswith(("fp8", "ct")))[0]
    decode = (NEW_TOKENS - 1) * layers
    # FP8: every one-token step's mixer takes its input norm in its first quantized
    # projection (GatedDeltaNet's qkv|z storing norm(x) for its 16-bit b|a) and, at TP 1,
    # the residual in its output projection; compressed-tensors NVFP4 the same in its
    # attention layers.
    fp8 = decode if case.endswith("fp8") else 0
    attention = counts.pop("attention layers")
    nvfp4 = (NEW_TOKENS - 1) * attention if case.endswith("ct") else 0
    # NVFP4 experts take neither the shared expert nor the residual, only the router's norm,
    # and the combine of their rounded sum with the gated shared expert at every step; the
    # others combine at the 5-token prefill only. At TP 1 every combine adds the residual.
    nvfp4_experts = case.endswith(("nvfp4", "ct"))
    rows = 0 if nvfp4_experts else decode
    combine = NEW_TOKENS * layers if nvfp4_experts else layers
    assert counts == {"combine": combine, "combine residual": combine if tp == 1 else 0,
                      "shared": rows, "residual": rows if tp == 1 else 0,
                      "normed": NEW_TOKENS * layers, "fp8 norm": fp8,
                      "fp8 residual": fp8 if tp == 1 else 0, "nvfp4 norm": nvfp4,
                      "nvfp4 residual": nvfp4 if tp == 1 else 0, "fp8 gated": 0,
                      "nvfp4 gated": decode if case.endswith("ct") else 0}, (counts, layers)
    _assert_same(want, got, f"{case} one sequence tp={tp}")
