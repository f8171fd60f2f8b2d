"""Requests are checked in the parent before dispatch: each bad request raises a ValueError
naming the prompt and the problem, and the same LLM (TP 2: the rank group survives) then
serves a good request. Engine options and sampling values no rank could take are refused
in the parent, naming the option. Non-finite weights and NVFP4 scales are refused at load,
naming the tensor."""

from __future__ import annotations

import math
import shutil

import pytest
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken import LLM, SamplingParams
from freetoken.distributed import RankError, RankGroup
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
                                          ("temperature", 1e-39),
                                          ("top_p", math.inf), ("top_p", math.nan),
                                          ("max_tokens", 0), ("max_tokens", 2.0),
                                          ("top_k", -1), ("seed", -1), ("seed", 2**63),
                                          ("seed", 2**64), ("ignore_eos", "no"),
                                          ("return_logits", 1)])
def test_sampling_params_refuse_what_no_rank_can_take(field, value):
    """SamplingParams refuses NaN, Inf, negative and non-integer values, seeds outside
    [0, 2**63) (a torch generator's range), temperatures whose division overflows float32
    logits (NaN probabilities on rank 0) and non-bool flags, naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _no_rank_may_start(group) -> None:
    raise AssertionError("a rank group started before the bad option was refused")


@pytest.mark.parametrize("option, value, needle", [
    ("block_size", 0, "block_size must be >= 1, got 0"),
    ("max_num_seqs", 2.5, "max_num_seqs must be an integer, got 2.5"),
    ("max_model_len", True, "max_model_len must be an integer, got True"),
    ("num_kv_blocks", -1, "num_kv_blocks must be >= 1, got -1"),
    ("num_layers", 99, "num_layers=99 exceeds the model's num_hidden_layers=2"),
    ("timeout", math.nan, "timeout must be a finite number of seconds above 0, got nan"),
    ("progress", "yes", "progress must be True or False, got 'yes'"),
    ("dtype", "int8", "dtype must be auto or one of float32, bfloat16, float16 (or fp32, bf16, "
                      "fp16), got 'int8'"),
    ("tp", "2", "tp must be an integer, got '2'"),
    ("max_num_seq", 4, "unknown engine option 'max_num_seq'"),
])
def test_engine_options_refused_before_any_rank_starts(monkeypatch, option, value, needle):
    """Every numeric (and flag) engine option no rank could take is a ValueError naming the
    option, raised before a rank group starts."""
    monkeypatch.setattr(RankGroup, "start", _no_rank_may_start)
    options = {"tp": 2, "device": "cpu", option: value}
    with pytest.raises(ValueError) as info:
        LLM(GOLDEN / "tiny-llama", **options)
    assert needle in str(info.value), f"{option}={value!r}: {info.value}"


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


def test_the_loading_bar_is_drawn_only_on_a_terminal(capfd):
    """An `LLM` built with its default progress setting draws no `loading:` bar into a stream
    that is not a terminal (a log, a captured stderr): bars redraw with carriage returns."""
    with LLM(GOLDEN / "tiny-llama", tp=1, device="cpu"):
        pass
    err = capfd.readouterr().err
    assert "loading" not in err and "\r" not in err, err[-500:]
