"""The engine against HF transformers, fp32 on CPU, at TP 1, 2 and 4.

Tolerance: prefill logits within rtol=1e-4, atol=1e-4 (docs/verification.md explains why:
TP only changes the order of fp32 reductions; observed differences are ~2e-6 to 2e-5 on
logits of magnitude ~5), and greedy continuations equal HF's `generate` token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import BUNDLED, GOLDEN, assert_matches_hf

from freetoken import LLM, SamplingParams
from freetoken_verify.cases.catalogue import hf_reference, make_prompts, rerandomise

NUM_GREEDY = 16


def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _engine_outputs(folder: Path, tp: int, prompts: list[list[int]]):
    params = SamplingParams(max_tokens=NUM_GREEDY, ignore_eos=True, return_prompt_logits=True)
    with LLM(folder, tp=tp, device="cpu", dtype="float32", progress=False) as llm:
        return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def live_reference():
    """HF outputs computed now from each bundled folder (not the stored golden)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            prompts = json.loads((GOLDEN / case / "meta.json").read_text())["prompts"]
            cache[case] = prompts, hf_reference(_hf_model(GOLDEN / case), prompts, NUM_GREEDY)
        return cache[case]

    return get


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", BUNDLED)
def test_bundled_case_matches_hf(case, tp, live_reference):
    """Prefill logits at every position of 3 prompts (5, 23, 70 tokens) and a 16-token greedy
    continuation match HF for every bundled model at TP 1, 2 and 4."""
    prompts, ref = live_reference(case)
    assert_matches_hf(_engine_outputs(GOLDEN / case, tp, prompts), ref, f"{case} tp={tp}")


def _make_sharded_checkpoint(kind: str, folder: Path) -> Path:
    """An HF model built here (dimensions unlike the bundled cases), saved in several
    safetensors shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=203, hidden_size=96, num_hidden_layers=3, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=8, intermediate_size=192)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
            norm_topk_prob=False, decoder_sparse_step=2))
    rerandomise(model.eval(), seed=5)
    model.save_pretrained(folder, max_shard_size="150KB")
    return folder


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_sharded_checkpoint_built_by_hf_matches(kind, tmp_path):
    """A checkpoint saved by `save_pretrained` in this test, split over several files, loads
    and matches HF at TP 1, 2 and 4 (llama with attention bias; MoE with dense and sparse
    layers and no top-k renormalisation)."""
    folder = _make_sharded_checkpoint(kind, tmp_path / kind)
    assert (folder / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    assert len(list(folder.glob("model-*.safetensors"))) > 1, "expected several shard files"
    prompts = make_prompts(7, (4, 17, 33), 203)
    ref = hf_reference(_hf_model(folder), prompts, NUM_GREEDY)
    for tp in (1, 2, 4):
        assert_matches_hf(_engine_outputs(folder, tp, prompts), ref, f"{kind} tp={tp}")


def test_batched_generation_equals_each_prompt_alone():
    """Continuous batching does not change results: a batch of 3 prompts gives the same tokens
    (and logits within fp32 noise) as generating each prompt on its own."""
    folder = GOLDEN / "tiny-qwen3-moe"
    prompts = json.loads((folder / "meta.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True)
    with LLM(folder, tp=2, device="cpu", progress=False) as llm:
        batched = llm.generate(prompts, params)
        alone = [llm.generate([p], params)[0] for p in prompts]
    for i, (b, a) in enumerate(zip(batched, alone)):
        assert b.token_ids == a.token_ids, f"prompt {i}: batched {b.token_ids} != {a.token_ids}"
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, i=i: f"prompt {i} step logits: {m}")
