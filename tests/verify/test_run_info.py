"""The identity of a run (freetoken_verify.report.run_info): the environment, the git state of a
checkout (and
none outside one), the source of a hub snapshot, and the run section built from a plan."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from freetoken import version
from freetoken.version import ROOT, git_state
from freetoken_verify.cases.catalogue import resolve_case
from freetoken_verify.checks import VerifyOptions
from freetoken_verify.report import run_info
from freetoken_verify.report.run_info import (
    environment,
    hub_source,
    model_entry,
    run_identity,
)
from freetoken_verify.running.runner import Plan

_ENV_KEYS = {"python", "platform", "torch", "triton", "transformers", "cuda", "nccl", "driver",
             "device", "gpus", "gpu_names", "cpu", "cpu_count"}
_ISO_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


def _make_checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "checkout"
    (repo / "verify").mkdir(parents=True)
    (repo / "verify" / "x.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "first")
    return repo


def _make_hub_snapshot(tmp_path: Path, ref: str | None) -> Path:
    """`models--Org--Name/snapshots/<hash>/config.json` as the HF cache lays it out, with
    `refs/<ref>` pointing at the snapshot when `ref` is given."""
    repo = tmp_path / "hub" / "models--Org--Tiny-Model"
    snapshot = repo / "snapshots" / ("0123abcd" * 5)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "other").write_text("f" * 40)
    if ref is not None:
        (repo / "refs" / ref).write_text(snapshot.name + "\n")
    return snapshot


def test_environment_names_software_and_hardware(monkeypatch):
    """Every env key is present with its type; a missing package is None; on a machine
    without a visible GPU the CUDA facts are None and the GPU list empty."""
    real_version = version.metadata.version

    def fake_version(name):
        if name == "triton":
            raise version.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(version.metadata, "version", fake_version)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    env = environment("cpu")
    assert set(env) == _ENV_KEYS, env.keys()
    assert env["triton"] is None and env["torch"] == real_version("torch")
    assert env["python"].count(".") == 2 and env["cpu_count"] >= 1
    assert (env["gpus"], env["gpu_names"], env["nccl"], env["driver"]) == (0, [], None, None)
    with pytest.raises(ValueError, match="auto"):
        environment("auto")


def test_environment_on_a_gpu_machine(monkeypatch):
    """With GPUs visible: their names, the NCCL version as `major.minor.patch`, and the
    driver as the first line `nvidia-smi` prints (one per GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H200 #{i}")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(run_info.shutil, "which", lambda name: f"/usr/bin/{name}")
    calls = []

    def nvidia_smi(args, cwd=None):
        calls.append(args)
        return "550.54.15\n550.54.15"

    monkeypatch.setattr(run_info, "command_output", nvidia_smi)
    env = environment("cuda")
    assert env["gpus"] == 2 and env["gpu_names"] == ["NVIDIA H200 #0", "NVIDIA H200 #1"]
    assert (env["nccl"], env["driver"]) == ("2.21.5", "550.54.15")
    assert calls and calls[0][0] == "nvidia-smi"
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: 2708)
    assert environment("cuda")["nccl"] == "2708"


def test_git_state_of_a_checkout_and_of_an_installed_package(tmp_path, monkeypatch):
    """In a checkout: HEAD and whether tracked files changed. Without `.git` next to the
    package (an installed wheel, even inside another repository) or without git: None."""
    repo = _make_checkout(tmp_path)
    head = _git(repo, "rev-parse", "HEAD")
    assert git_state(repo) == (head, False)
    (repo / "verify" / "x.py").write_text("x = 2\n")
    assert git_state(repo) == (head, True)
    assert git_state(repo / "verify") == (None, None), "a subfolder is not the checkout root"
    monkeypatch.setattr(version.shutil, "which", lambda name: None)
    assert git_state(repo) == (None, None)


def test_hub_source_reads_id_snapshot_and_ref(tmp_path):
    """A hub cache snapshot yields its hub id, snapshot hash and the ref pointing at it; a
    snapshot no ref points at has no revision; any other folder only a path."""
    snapshot = _make_hub_snapshot(tmp_path, "main")
    assert hub_source(snapshot) == {"path": str(snapshot.resolve()), "hub_id": "Org/Tiny-Model",
                                    "revision": "main", "snapshot": snapshot.name}
    unnamed = _make_hub_snapshot(tmp_path / "other", None)
    assert hub_source(unnamed)["revision"] is None and hub_source(unnamed)["snapshot"]
    plain = tmp_path / "plain"
    plain.mkdir()
    assert hub_source(plain) == {"path": str(plain.resolve()), "hub_id": None,
                                 "revision": None, "snapshot": None}


def test_model_entry_resolves_dtype_reference_and_source():
    """`auto` dtype is the checkpoint's own; a bundled case at full depth is checked against
    its stored golden, truncated against live HF; what model resolution recorded on the case
    wins over what the path says, and every source has all four keys."""
    case = resolve_case("tiny-llama")
    entry = model_entry(case, VerifyOptions())
    assert (entry["dtype"], entry["reference"], entry["bundled"]) == ("float32", "golden", True)
    assert entry["source"]["path"] == str(case.folder.resolve())
    entry = model_entry(case, VerifyOptions(dtype="bfloat16", num_layers=1))
    assert (entry["dtype"], entry["reference"]) == ("bfloat16", "hf")
    source = {"path": "/cache/x", "hub_id": "Org/X", "revision": "v1", "snapshot": "a"}
    recorded = SimpleNamespace(name="Org/X", bundled=False, folder=case.folder,
                               model_config=case.model_config, source=source)
    assert model_entry(recorded, VerifyOptions())["source"] == source
    partial = SimpleNamespace(**{**vars(recorded), "source": {"path": "/elsewhere"}})
    assert model_entry(partial, VerifyOptions())["source"] == {
        "path": "/elsewhere", "hub_id": None, "revision": None, "snapshot": None}


def test_run_identity_records_request_and_code():
    """The run section holds the resolved request (models, TP sizes, checks, faults, every
    option), the start time in ISO 8601 UTC, no end time yet, and this code's git state."""
    options = VerifyOptions(dtype="bfloat16", reference="hf", timeout=30.0)
    plan = Plan([resolve_case("tiny-llama")], [1, 2], {"golden": None, "shards": None}, options,
                ("drop-allreduce",))
    run = run_identity(plan, run_info.utc_now())
    assert run["arguments"] == {"models": ["tiny-llama"], "tp": [1, 2],
                                "checks": ["golden", "shards"], "faults": ["drop-allreduce"],
                                **asdict(options)}
    assert run["arguments"]["timeout"] == 30.0 and run["arguments"]["reference"] == "hf"
    assert (run["dtype"], run["reference"], run["faults"]) == ("bfloat16", "hf",
                                                              ["drop-allreduce"])
    assert _ISO_UTC.match(run["started"]) and run["finished"] is None
    # This test runs from the checkout: the report names its HEAD (not None: the package
    # finds the checkout root above itself).
    head = _git(ROOT, "rev-parse", "HEAD")
    assert run["git_commit"] == head and isinstance(run["git_dirty"], bool), run
    assert run["version"] == version.package_version("freetoken")


def test_an_installed_build_reports_the_commit_it_was_built_from(monkeypatch):
    """Outside a checkout the commit comes from what setup.py baked into the build
    (`freetoken._build_info`); with neither, None; `--version` says the commit."""
    monkeypatch.setattr(version, "git_state", lambda root=None: (None, None))
    monkeypatch.setitem(sys.modules, "freetoken._build_info", None)  # import fails
    assert version.code_state() == (None, None)
    built = types.ModuleType("freetoken._build_info")
    built.COMMIT, built.DIRTY = "ab" * 20, True
    monkeypatch.setitem(sys.modules, "freetoken._build_info", built)
    assert version.code_state() == ("ab" * 20, True)
    assert version.describe("freetoken").endswith("(commit abababababab, modified)")
