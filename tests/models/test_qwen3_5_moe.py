"""Qwen3.5-MoE in the engine against HF transformers, fp32 on CPU, at TP 1, 2, 4 and 8.

Tolerance: logits within rtol=1e-4, atol=1e-4 and greedy ids equal, as for the other models.
HF's own fp32 forward is ~5e-5 away from its fp64 forward on the bundled case (4 layers of
re-randomised weights), and the engine's error against HF is of that size at every TP size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN, assert_matches_hf

from freetoken import LLM, SamplingParams
from freetoken_verify.cases.catalogue import hf_reference, load_reference, make_prompts, rerandomise

CASE = "tiny-qwen3.5-moe"
NUM_GREEDY = 24
TP_SIZES = [1, 2, 4, 8]


def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_GREEDY, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def bundled():
    """(folder, prompts, live HF reference) of the bundled case."""
    folder = GOLDEN / CASE
    prompts = json.loads((folder / "meta.json").read_text())["prompts"]
    return folder, prompts, hf_reference(_hf_model(folder), prompts, NUM_GREEDY)


@pytest.fixture(scope="module", params=TP_SIZES, ids=lambda tp: f"tp{tp}")
def engine(request):
    """One LLM on the bundled case per TP size, shared by the tests that use it."""
    with LLM(GOLDEN / CASE, tp=request.param, device="cpu", dtype="float32",
             progress=False) as llm:
        yield request.param, llm


def test_stored_reference_is_live_hf(bundled):
    """The bundled case's stored reference (what `freetoken-verify` compares with) is what HF
    computes now: same prompts (5, 23, 70 tokens), same greedy ids, logits to fp32 noise."""
    folder, prompts, live = bundled
    meta, stored = load_reference(folder)
    assert [len(p) for p in meta["prompts"]] == [5, 23, 70], meta["prompts"]
    assert meta["num_greedy"] == NUM_GREEDY, meta["num_greedy"]
    for key, tensor in stored.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(live[key], tensor, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, key=key: f"{key}: {m}")
        else:
            assert torch.equal(live[key], tensor), f"{key}: live HF differs from stored"


def test_preempted_sequence_recomputes_its_state(monkeypatch, bundled):
    """With a cache too small for all three sequences, the newest is preempted mid-decode and
    later re-prefilled from scratch into a reused state slot; every result still matches HF."""
    from freetoken.config import EngineConfig
    from freetoken.engine.core import EngineCore
    from freetoken.engine.scheduler import Scheduler
    from freetoken.models.registry import load_config

    folder, prompts, ref = bundled
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt",
                        lambda self, seq: (preempted.append(seq.seq_id), original(self, seq)))
    cfg = EngineConfig(dtype="float32", block_size=8, num_kv_blocks=13, max_num_seqs=3,
                       progress=False)
    core = EngineCore(folder, load_config(folder), cfg, torch.device("cpu"))
    params = _params(return_logits=True, return_prompt_logits=True)
    results = core.generate(prompts, [params] * len(prompts))
    assert preempted, "the cache was expected to force a preemption"
    for i, result in enumerate(results):
        assert result.token_ids == ref[f"greedy_ids_{i}"].tolist(), (
            f"prompt {i} (preempted: {preempted}): {result.token_ids} != HF "
            f"{ref[f'greedy_ids_{i}'].tolist()}")
        torch.testing.assert_close(result.logits, ref[f"greedy_logits_{i}"], rtol=1e-4,
                                   atol=1e-4, msg=lambda m, i=i: f"prompt {i} decode: {m}")


def _make_hf_checkpoint(folder: Path) -> Path:
    """`Qwen3_5MoeForCausalLM` (text-only layout, `model.` prefix) saved by HF in several
    files, with dimensions unlike the bundled case: attention first, 4 KV heads (replicated
    at TP 8), 3 value heads per key head, dk < dv, conv kernel 3, half-rotary heads, 6
    experts top-3, tied embeddings, odd vocab 203."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=203, hidden_size=48, num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        linear_num_key_heads=8, linear_num_value_heads=24, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=3,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    torch.manual_seed(3)
    model = Qwen3_5MoeForCausalLM(config).eval()
    rerandomise(model, seed=5)
    model.save_pretrained(folder, max_shard_size="200KB")
    return folder


def test_checkpoint_built_by_hf_matches(tmp_path):
    """A text-only checkpoint saved by `save_pretrained` in this test (sharded over several
    files) matches HF at TP 1, 2, 4 and 8: prompt logits, 24 greedy tokens and their logits,
    for prompts of 3, 19 and 81 tokens."""
    folder = _make_hf_checkpoint(tmp_path / "qwen3_5_moe")
    assert len(list(folder.glob("model-*.safetensors"))) > 1, "expected several shard files"
    prompts = make_prompts(7, (3, 19, 81), 203)
    ref = hf_reference(_hf_model(folder), prompts, NUM_GREEDY)
    for tp in TP_SIZES:
        with LLM(folder, tp=tp, device="cpu", dtype="float32", progress=False) as llm:
            results = llm.generate(prompts, _params(return_logits=True,
                                                    return_prompt_logits=True))
        assert_matches_hf(results, ref, f"hf-built tp={tp}", decode_logits=True)


def test_bundled_case_matches_hf(engine, bundled):
    """For a batch of 3 prompts (5, 23 and 70 tokens; 70 spans two 64-token prefill chunks),
    logits at every prompt position and a 24-token greedy continuation, with its logits (decode
    through the conv and recurrent states), match HF at every TP size."""
    tp, llm = engine
    _, prompts, ref = bundled
    results = llm.generate(prompts, _params(return_logits=True, return_prompt_logits=True))
    assert_matches_hf(results, ref, f"{CASE} tp={tp}", decode_logits=True)


@pytest.mark.parametrize("engine", [1, 2], indirect=True, ids=lambda tp: f"tp{tp}")
def test_batched_generation_equals_each_prompt_alone(engine, bundled):
    """Sequences batched together keep separate GatedDeltaNet states: a batch of 3 prompts
    gives the same tokens, and logits within fp32 noise, as generating each prompt alone
    (at TP 1 and 2; the state slots are the same on every rank)."""
    tp, llm = engine
    _, prompts, _ = bundled
    params = _params(return_logits=True)
    batched = llm.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        alone = llm.generate([prompt], params)[0]
        assert batched[i].token_ids == alone.token_ids, (
            f"tp={tp} prompt {i}: batched {batched[i].token_ids} != alone {alone.token_ids}")
        torch.testing.assert_close(batched[i].logits, alone.logits, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, i=i: f"tp={tp} prompt {i} step logits: {m}")
