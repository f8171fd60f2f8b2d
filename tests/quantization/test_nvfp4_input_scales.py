"""Stored input scales the weight-only engine drops: NVFP4's (ModelOpt `input_scale`, 0-d or
[1]; compressed-tensors' divisor `input_global_scale`, [1]; one per routed-expert projection,
and an NVFP4 lm_head's) and those of FP8 modules whose config declares dynamic inputs. Each is
checked before it is dropped (`Rule.checked`): a NaN, infinite, zero, negative or non-scalar
one is refused at load naming the tensor and what it is; a good one changes nothing the
engine loads; shards states them as dropped scalars and runs the same check; the dequantized
twin refuses a bad one and drops a good one; `freetoken generate` and `freetoken-verify`
report the refusal in one line, no traceback."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import GOLDEN, shards_audit
from quant_folders import compressed_tensors_fp8_llama, modelopt_nvfp4_llama, with_tensor
from safetensors.torch import load_file

import freetoken.engine.core as core
from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.fp8.tensor import ScalarScale
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.format import QuantConfigError
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.formats.shard import ShardError
from freetoken.loading import CheckpointReader
from freetoken.loading.plan import Rule
from freetoken.models import registry
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.cli import main
from freetoken_verify.faults._patch import rewrite_plans

L = "model.language_model.layers"
NVFP4_CT = GOLDEN / "tiny-qwen3.5-moe-nvfp4-ct"
NVFP4_MODELOPT = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
MIXED = GOLDEN / "tiny-qwen3.5-moe-mixed"
NVFP4 = "NVFP4 input scale"
BAD = pytest.mark.parametrize("value", [math.nan, 0.0, -0.5], ids=["nan", "zero", "negative"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The source folders the cases rewrite: ModelOpt NVFP4 on every tiny-llama projection
    (no input scales stored: the cases add them), compressed-tensors FP8 per tensor and block
    with `dynamic: true` input activations but the `input_scale` tensors still stored."""
    root = tmp_path_factory.mktemp("src")
    out = {"modelopt-llama": modelopt_nvfp4_llama(root / "modelopt-llama")}
    for strategy in ("tensor", "block"):
        folder = compressed_tensors_fp8_llama(root / f"fp8-{strategy}", strategy)
        config = json.loads((folder / "config.json").read_text())
        group = config["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"]["dynamic"] = True
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        out[f"fp8-{strategy}"] = folder
    return out


CASES = {
    # case: (source folder, stored input scale, what the error calls it, shape when added)
    "modelopt-dense": ("modelopt-llama", "model.layers.1.mlp.up_proj.input_scale", NVFP4, ()),
    "modelopt-dense-1": ("modelopt-llama", "model.layers.0.self_attn.k_proj.input_scale", NVFP4,
                         (1,)),
    "ct-attention": (NVFP4_CT, f"{L}.1.self_attn.k_proj.input_global_scale", NVFP4, None),
    "ct-shared-expert": (NVFP4_CT, f"{L}.0.mlp.shared_expert.down_proj.input_global_scale",
                         NVFP4, None),
    "ct-experts": (NVFP4_CT, f"{L}.0.mlp.experts.3.gate_proj.input_global_scale", NVFP4, None),
    "modelopt-experts": (NVFP4_MODELOPT, f"{L}.2.mlp.experts.5.up_proj.input_scale", NVFP4,
                         None),
    "lm-head": (MIXED, "lm_head.input_scale", NVFP4, ()),
    "fp8-tensor-dynamic": ("fp8-tensor", "model.layers.1.mlp.up_proj.input_scale",
                           "FP8 per-tensor input scale", None),
    "fp8-block-dynamic": ("fp8-block", "model.layers.0.self_attn.k_proj.input_scale",
                          "FP8 block input scale", None),
}
ALL = pytest.mark.parametrize("case", list(CASES))


def _source(folders, case: str):
    src = CASES[case][0]
    return folders[src] if isinstance(src, str) else src


def _make_case(folders, tmp_path, case: str, value: float, label: str = "case"):
    """A copy of the case's source folder with its input scale set to (or added as) `value`."""
    _, name, _, shape = CASES[case]
    return with_tensor(_source(folders, case), tmp_path / label, name, value, shape)


def _load(folder, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    reset_tp_info()
    set_tp_info(TPInfo(rank, tp))
    try:
        cfg = load_config(folder)
        model = build_model(cfg)
        core.load_weights(model, CheckpointReader(folder, None), shard_plan(cfg, tp),
                          progress=False)
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        reset_tp_info()


def _refusal(case: str, value: float) -> str:
    _, name, what, _ = CASES[case]
    return re.escape(f"{name}: {what} {value} is not finite and above 0")


def _assert_same_params(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), f"{label}: parameters differ"
    for n, p in want.items():
        assert torch.equal(got[n].reshape(-1).view(torch.uint8),
                           p.reshape(-1).view(torch.uint8)), f"{label}: {n}"


def test_the_cases_hold_what_they_say(folders):
    """Each case's tensor is stored where the source has it (the bundled NVFP4 cases and the
    dynamic FP8 folders), in the producer's shape; the plan drops it after a check."""
    for case, (_, name, _, shape) in CASES.items():
        stored = load_file(_source(folders, case) / "model.safetensors")
        if shape is None:
            assert name in stored and tuple(stored[name].shape) in ((), (1,)), case
        else:
            assert name not in stored, f"{case}: the source already stores {name}"
        target = shard_plan(load_config(_source(folders, case)), 2).resolve(name)
        assert target.param is None and isinstance(target.rule.checked, ScalarScale), case


@ALL
@BAD
def test_a_bad_dropped_input_scale_is_refused_naming_the_tensor(folders, tmp_path, case, value):
    """NaN, zero or negative: the load stops naming the tensor and what it is."""
    bad = _make_case(folders, tmp_path, case, value)
    with pytest.raises(ShardError, match=_refusal(case, value)):
        _load(bad)


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_refuses_an_infinite_one(folders, tmp_path, rank):
    """An infinite routed-expert input scale is refused on each rank at TP 2."""
    bad = _make_case(folders, tmp_path, "ct-experts", math.inf)
    with pytest.raises(ShardError, match=_refusal("ct-experts", math.inf)):
        _load(bad, 2, rank)


@pytest.mark.parametrize("case", ["ct-attention", "modelopt-experts", "fp8-block-dynamic"])
def test_a_non_scalar_input_scale_is_refused(folders, tmp_path, case):
    """A per-tensor input scale of two elements is no producer's: refused naming it."""
    _, name, what, _ = CASES[case]
    bad = with_tensor(_source(folders, case), tmp_path / "two", name, 0.5, (2,))
    with pytest.raises(ShardError, match=re.escape(f"{name}: {what} must be a float scalar, "
                                                   "got torch.float32 (2,)")):
        _load(bad)


@ALL
def test_a_good_input_scale_loads_and_changes_nothing(folders, tmp_path, case):
    """Another good value (or, where the source has none, an added one) loads, and every
    parameter is bit for bit what the source loads: the scale is dropped, at TP 2 too."""
    good = _make_case(folders, tmp_path, case, 0.375)
    _assert_same_params(_load(good), _load(_source(folders, case)), case)
    if case in ("ct-experts", "lm-head"):
        _assert_same_params(_load(good, 2, 1), _load(_source(folders, case), 2, 1),
                            f"{case} tp=2")


def _shards_failures(folder, tp: int, rank: int) -> list[str]:
    return shards_audit(folder, tp, rank)["failures"]


@pytest.mark.parametrize("case", ["modelopt-dense", "ct-shared-expert", "lm-head",
                                  "fp8-tensor-dynamic"])
def test_shards_states_them_dropped_and_checks_them(folders, tmp_path, case):
    """shards passes a good case (the plan's drop agrees with the layout's statement) and
    fails a NaN one naming the tensor and what it is."""
    _, name, what, _ = CASES[case]
    good = _make_case(folders, tmp_path, case, 0.375, "good")
    assert not _shards_failures(good, 2, 0), case
    bad = _make_case(folders, tmp_path, case, math.nan, "bad")
    failures = _shards_failures(bad, 2, 1)
    assert failures == [f"{name}: {what} nan is not finite and above 0"], failures


def test_shards_states_the_shape_of_a_dropped_scale(folders, tmp_path):
    """A two-element NVFP4 input scale disagrees with the layout's statement (a scalar) as
    well as with the plan's check; both name the tensor."""
    _, name, _, _ = CASES["ct-attention"]
    bad = with_tensor(NVFP4_CT, tmp_path / "two", name, 0.5, (2,))
    failures = _shards_failures(bad, 1, 0)
    assert f"{name}: shape (2,), the config and its format give () or (1,)" in failures, \
        failures
    assert any(f.startswith(f"{name}: {NVFP4} must be a float scalar") for f in failures), \
        failures


def test_the_twin_refuses_a_bad_one_and_drops_a_good_one(folders, tmp_path):
    """The dequantized twin (HF's reference) checks an NVFP4 input scale naming the module
    and keeps none."""
    _, name, _, _ = CASES["ct-attention"]
    bad = _make_case(folders, tmp_path, "ct-attention", 0.0, "bad")
    with pytest.raises(QuantConfigError, match=re.escape(name.rpartition(".")[0])):
        write_dequantized_twin(bad, tmp_path / "twin-bad", read_quant_config(bad))
    twin = write_dequantized_twin(NVFP4_CT, tmp_path / "twin", read_quant_config(NVFP4_CT))
    names = load_file(twin / "model.safetensors")
    assert names and not any(n.endswith("input_global_scale") for n in names)


def test_freetoken_verify_reports_a_bad_one_naming_it(folders, tmp_path, capsys):
    """`freetoken-verify --model FOLDER`: memory (which loads the engine) errors and shards
    fails, both naming the tensor and the refusal; exit 1, no traceback."""
    _, name, _, _ = CASES["modelopt-experts"]
    bad = _make_case(folders, tmp_path, "modelopt-experts", math.nan)
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(bad), "--tp", "1", "--checks", "memory,shards",
              "--report-json", str(report)])
    out = capsys.readouterr()
    rows = json.loads(report.read_text())["results"]
    assert exit_info.value.code == 1, rows
    want = f"{name}: {NVFP4} nan is not finite and above 0"
    assert [r["status"] for r in rows] == ["error", "fail"], rows
    assert all(want in r["message"] for r in rows), [r["message"] for r in rows]
    assert "Traceback" not in out.out + out.err, out.err[-2000:]


def test_freetoken_generate_refuses_a_bad_one_in_one_line(folders, tmp_path):
    """`freetoken generate` on a checkpoint with a negative NVFP4 input scale: exit 2, the
    last line `error: ...` naming the tensor, no traceback."""
    _, name, _, _ = CASES["ct-shared-expert"]
    bad = _make_case(folders, tmp_path, "ct-shared-expert", -0.5)
    result = subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--model",
                             str(bad), "--prompt-ids", "1,2", "--max-new-tokens", "1",
                             "--device", "cpu"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{name}: {NVFP4} -0.5 is not finite" in last, \
        result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_the_check_is_what_refuses_them(folders, tmp_path, monkeypatch):
    """Injected bug: the plans drop input scales unchecked (the rules before this check).
    The bad checkpoints then load silently and shards passes them: nothing else catches a
    broken input scale, so the check must stay."""
    bad = {case: _make_case(folders, tmp_path, case, math.nan, case)
           for case in ("ct-attention", "modelopt-experts", "lm-head", "fp8-tensor-dynamic")}
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))
    rewrite_plans(lambda rule: dataclasses.replace(rule, checked=None))
    for case, folder in bad.items():
        assert _load(folder), case
    assert not _shards_failures(bad["ct-attention"], 2, 0)


def test_checked_is_only_for_a_dropped_tensor():
    """A rule that loads its tensor checks it with its spec: `checked` there is a plan bug."""
    with pytest.raises(ValueError, match="`checked` is for a tensor it drops"):
        Rule(r"x\.input_scale", ScalarScale(), "x.input_scale", checked=ScalarScale())
