"""The architecture table (freetoken.models.registry): an HF config finds its family by
`architectures` or `model_type`, the family's parser sets what differs between families, and
errors name the architecture or the file."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from freetoken.config import ConfigError
from freetoken.models.registry import ARCHITECTURES, architecture, config_from_hf, load_config
from freetoken_verify.cases.catalogue import CASES, bundled_folder, resolve_case


def _make_hf(case: str, **changes) -> dict:
    """A bundled case's config.json with `changes` applied (None deletes a key)."""
    hf = json.loads((resolve_case(case).folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    return hf


def test_every_hf_architecture_and_model_type_finds_its_family():
    """Each name in the table resolves to the family that lists it, by `architectures` and,
    without it, by `model_type`."""
    for family in ARCHITECTURES.values():
        for name in family.hf_architectures:
            assert architecture({"architectures": [name]}) is family, name
        for model_type in family.model_types:
            assert architecture({"model_type": model_type}) is family, model_type


def test_an_unknown_architecture_lists_the_supported_ones():
    """An architecture no family serves is a ConfigError naming it and the supported ones."""
    with pytest.raises(ConfigError, match=r"'MambaForCausalLM'.*LlamaForCausalLM"):
        config_from_hf({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})


@pytest.mark.parametrize("case,qk_norm,default_topk", [
    ("tiny-llama", False, True), ("tiny-qwen3", True, True), ("tiny-qwen3-moe", True, False),
])
def test_family_parsers_set_what_differs_between_families(case, qk_norm, default_topk):
    """q/k norms come from the family; a config without `norm_topk_prob` gets the family's
    default (HF's: Qwen3-MoE does not renormalise, the others do)."""
    cfg = config_from_hf(_make_hf(case, norm_topk_prob=None))
    assert (cfg.qk_norm, cfg.norm_topk_prob) == (qk_norm, default_topk), case


def test_a_quantized_module_the_engine_does_not_run_is_refused_by_name():
    """An FP8 quantization config on a Llama checkpoint that leaves lm_head quantized is a
    ConfigError naming lm_head and its format (only NVFP4 lm_heads run), not a model that
    would load the fp8 weights as floats."""
    quant = {"quant_method": "modelopt", "quant_algo": "FP8"}
    with pytest.raises(ConfigError, match=r"lm_head is FP8 per-tensor \(modelopt\), which "
                                          r"FreeToken does not support for lm_head"):
        config_from_hf(_make_hf("tiny-llama", quantization_config=quant))


def test_load_config_names_the_file(tmp_path):
    """A folder without config.json, and a config.json missing a key, name the path."""
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_make_hf("tiny-llama",
                                                               vocab_size=None)))
    with pytest.raises(ConfigError, match=r"config\.json: missing key 'vocab_size'"):
        load_config(tmp_path)


@pytest.mark.parametrize("case", sorted(c for c in CASES if bundled_folder(c) is not None))
def test_the_parsed_config_is_frozen_and_survives_the_trip_to_a_rank(case):
    """The launcher sends its parsed ModelConfig to the ranks (pickled through their pipes)
    instead of each rank reading config.json: the copy equals it field for field, its
    resolved module formats and raw config included, and neither can be changed."""
    cfg = load_config(bundled_folder(case))
    copy = pickle.loads(pickle.dumps(cfg))
    assert type(copy) is type(cfg) and copy == cfg, case
    assert copy.module_formats == cfg.module_formats and copy.raw == cfg.raw, case
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.num_hidden_layers = 1
