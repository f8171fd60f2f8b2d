"""Requests are checked in the parent before dispatch: each bad request raises a ValueError
naming the prompt and the problem, and the same LLM (TP 2: the rank group survives) then
serves a good request. Non-finite weights and NVFP4 scales are refused at load, naming the
tensor."""

from __future__ import annotations

import math
import shutil

import pytest
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken import LLM, SamplingParams
from freetoken.distributed import RankError
from freetoken.formats.shard import ShardError
from freetoken.loading.finite import NonFiniteError

_BAD_REQUESTS = [
    ([[]], None, "prompt 0 is empty"),
    ([], None, "no prompts given"),
    ([[1, 99999]], None, "token ids [99999] outside the vocabulary [0, 301)"),
    ([[1, -1]], None, "token ids [-1] outside the vocabulary"),
    ([[1, 2.5]], None, "token ids must be integers, got 2.5"),
    ([[1] * 500], SamplingParams(max_tokens=32), "500 tokens + max_tokens=32 exceed"),
    ([[1], [2]], [SamplingParams()], "1 SamplingParams for 2 prompts"),
]


@pytest.mark.parametrize("field, value", [("temperature", math.nan), ("temperature", -1.0),
                                          ("top_p", math.inf), ("top_p", math.nan),
                                          ("max_tokens", 0), ("max_tokens", 2.0),
                                          ("top_k", -1)])
def test_sampling_params_refuse_non_finite_and_negative(field, value):
    """SamplingParams refuses NaN, Inf, negative and non-integer values, naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _assert_bad_requests_refused(llm: LLM) -> None:
    for prompts, params, needle in _BAD_REQUESTS:
        with pytest.raises(ValueError) as info:
            llm.generate(prompts, params)
        assert needle in str(info.value), f"{prompts!r:.40}: {info.value}"


def test_bad_requests_then_a_good_one_at_tp2():
    """At TP 2 every bad request is refused in the parent and the rank group keeps serving:
    the good request afterwards returns its tokens."""
    with LLM(GOLDEN / "tiny-llama", tp=2, device="cpu", max_model_len=256) as llm:
        _assert_bad_requests_refused(llm)
        result = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(result[0].token_ids) == 3, result


def _make_nan_copy(tmp_path, case: str, tensor: str):
    folder = tmp_path / case
    shutil.copytree(GOLDEN / case, folder)
    tensors = load_file(folder / "model.safetensors")
    flat = tensors[tensor].view(-1)
    flat[flat.numel() // 2] = math.nan
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("case, tensor", [
    ("tiny-llama", "model.layers.1.mlp.down_proj.weight"),
    ("tiny-qwen3.5-moe-nvfp4", "model.language_model.layers.0.mlp.experts.3.up_proj"
                               ".weight_scale_2"),
])
def test_nan_weight_and_nan_scale_are_refused_at_load(tmp_path, case, tensor):
    """A NaN in a weight or in an NVFP4 global scale stops the load with an error that says
    NaN and names the tensor (it used to load and produce garbage)."""
    names = load_file(GOLDEN / case / "model.safetensors").keys()
    assert tensor in names, f"{tensor} not in {case}: {sorted(names)[:5]}"
    folder = _make_nan_copy(tmp_path, case, tensor)
    with pytest.raises((NonFiniteError, ShardError)) as info:
        LLM(folder, tp=1, device="cpu")
    assert tensor in str(info.value) and "NaN" in str(info.value), str(info.value)


def test_nan_weight_names_the_tensor_from_a_rank(tmp_path):
    """At TP 2 the rank that finds the NaN reports it as the root failure with its type."""
    tensor = "model.layers.0.self_attn.q_proj.weight"
    folder = _make_nan_copy(tmp_path, "tiny-llama", tensor)
    with pytest.raises(RankError) as info:
        LLM(folder, tp=2, device="cpu")
    assert info.value.summary.startswith("NonFiniteError:") and tensor in info.value.summary, \
        info.value.summary
