"""The bundled golden data stays trustworthy: weights match their recorded sha256, live HF
still reproduces the stored reference, and regeneration is byte-for-byte deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import BUNDLED, GOLDEN, case_differences

from freetoken_verify.activations.hf import hf_activations
from freetoken_verify.cases import bisect_file
from freetoken_verify.cases.catalogue import (
    CASES,
    hf_reference,
    load_reference,
    resolve_case,
    sha256_file,
    write_pinned,
)
from freetoken_verify.cases.numerics import pinned_env


@pytest.mark.parametrize("case", BUNDLED)
def test_weights_match_recorded_sha256(case):
    """model*.safetensors hash to the values meta.json recorded when the case was written."""
    meta = json.loads((GOLDEN / case / "meta.json").read_text())
    for name, digest in meta["weights_sha256"].items():
        assert sha256_file(GOLDEN / case / name) == digest, f"{case}/{name}: sha256 changed"


@pytest.mark.parametrize("case", BUNDLED)
def test_live_hf_reproduces_stored_reference(case):
    """HF transformers, run now on the stored weights, gives the stored prefill logits (fp32
    noise only) and exactly the stored greedy continuation."""
    from transformers import AutoModelForCausalLM

    meta, stored = load_reference(GOLDEN / case)
    model = AutoModelForCausalLM.from_pretrained(GOLDEN / case, dtype=torch.float32).eval()
    live = hf_reference(model, meta["prompts"], meta["num_greedy"])
    assert set(live) == set(stored), f"{case}: reference keys differ"
    for key, tensor in stored.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(live[key], tensor, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, key=key: f"{case} {key}: {m}")
        else:
            assert torch.equal(live[key], tensor), f"{case} {key}: live HF differs"


def test_regeneration_is_deterministic(tmp_path):
    """`make golden`'s writer, in its pinned numeric environment, writes the committed case
    (with the versions meta.json records): config, weights and token ids the same bytes,
    reference logits and the bf16 / fp16 baselines equal within `case_differences`' float
    rounding. It runs in a fresh process whatever this one's torch was started with
    (ATEN_CPU_CAPABILITY=default included), so the result does not depend on this CPU."""
    name = "tiny-qwen3-moe"
    meta = json.loads((GOLDEN / name / "meta.json").read_text())
    if (meta["torch"], meta["transformers"]) != (torch.__version__.split("+")[0],
                                                 transformers.__version__):
        pytest.skip("installed torch/transformers differ from the ones golden was written with")
    (written,) = write_pinned([name], tmp_path)
    assert case_differences(written, GOLDEN / name) == [], (
        f"freetoken_verify/golden/{name} is not what `make golden` writes now")


def test_the_writer_pins_its_numerics(tmp_path):
    """The writer's environment overrides the caller's kernel choices (a caller running the
    scalar kernels, ATEN_CPU_CAPABILITY=default, draws other random weights) and oneDNN is
    off in it: what `make golden` writes does not follow the machine's instruction set."""
    env = pinned_env({"ATEN_CPU_CAPABILITY": "default", "PATH": "/usr/bin"})
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "AVX2", env
    probe = ("import torch; from freetoken_verify.cases.numerics import check_pinned; "
             "print(check_pinned(torch), torch.backends.mkldnn.enabled)")
    proc = subprocess.run([sys.executable, "-c", probe], env=pinned_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.split() == ["None", "False"], proc.stdout + proc.stderr

def test_case_differences_finds_a_changed_case(tmp_path):
    """The golden comparison fails on a changed reference logit, token id, weight or config
    and on a baseline number far off, and passes float rounding."""
    import shutil

    from safetensors.torch import load_file, save_file

    name = "tiny-qwen3-moe"
    assert case_differences(GOLDEN / name, GOLDEN / name) == []
    for change in ("rounding", "logit", "token", "config", "baseline"):
        case = tmp_path / change
        shutil.copytree(GOLDEN / name, case)
        ref = load_file(case / "reference.safetensors")
        if change in ("rounding", "logit"):
            key = next(k for k in ref if ref[k].is_floating_point())
            ref[key] = ref[key].clone()
            ref[key][0, 0] += 5e-6 if change == "rounding" else 1e-2
        elif change == "token":
            key = next(k for k in ref if not ref[k].is_floating_point())
            ref[key] = ref[key].clone()
            ref[key][0] += 1
        save_file(ref, case / "reference.safetensors")
        if change == "config":
            (case / "config.json").write_text((case / "config.json").read_text() + " ")
        if change == "baseline":
            meta = json.loads((case / "meta.json").read_text())
            entry = meta["baselines"]
            while not isinstance(entry, dict) or not any(
                    isinstance(v, float) for v in entry.values()):
                entry = next(iter(entry.values())) if isinstance(entry, dict) else entry[0]
            key = next(k for k, v in entry.items() if isinstance(v, float))
            entry[key] += 1.0
            (case / "meta.json").write_text(json.dumps(meta))
        found = case_differences(case, GOLDEN / name)
        assert (found == []) == (change == "rounding"), (change, found)


def test_bundled_cases_are_package_data():
    """`freetoken_verify.cases.catalogue` finds every bundled case inside the installed
    `freetoken_verify` package (where a
    wheel puts them), each with the files the harness reads."""
    import freetoken_verify
    from freetoken_verify.cases import catalogue as cases

    package = Path(freetoken_verify.__file__).resolve().parent
    assert cases.GOLDEN.resolve() == package / "golden", cases.GOLDEN
    for name in CASES:
        for file in ("config.json", "model.safetensors", "reference.safetensors", "meta.json"):
            assert (cases.GOLDEN / name / file).is_file(), f"{name}/{file} missing from package"


@pytest.mark.parametrize("case", sorted(p.name for p in GOLDEN.iterdir()
                                        if (p / "meta.json").is_file()))
def test_stored_bisect_activations_are_live_hf(case):
    """Every bundled case keeps HF's float32 module outputs on the bisect prompt and HF's
    greedy token after it (bisect compares with them instead of running HF): HF run now
    through the harness's own loader (on the dequantized twin for a quantized case) picks
    the same prompt and token and gives the same outputs within fp32 noise (2e-5 observed
    between thread counts)."""
    from freetoken_verify.checks.base import VerifyOptions
    from freetoken_verify.reference.sources import hf_model

    meta, stored = load_reference(GOLDEN / case)
    kept = bisect_file.load(GOLDEN / case, meta.get("bisect"))
    assert kept is not None, f"{case}: no stored bisect activations"
    prompt, token, by_dtype = kept
    assert by_dtype.keys() == {"float32"}, by_dtype.keys()
    model = hf_model(resolve_case(case), VerifyOptions(), torch.float32, torch.device("cpu"))
    logits = [stored[f"prefill_logits_{i}"] for i in range(len(meta["prompts"]))]
    assert bisect_file.record(model, meta["prompts"], logits)[:2] == (prompt, token)
    live = hf_activations(model, prompt + [token])
    assert live.keys() == by_dtype["float32"].keys(), f"{case}: other HF modules"
    for name, tensor in by_dtype["float32"].items():
        torch.testing.assert_close(live[name], tensor, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{case} bisect {name}: {m}")
