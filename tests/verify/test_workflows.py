"""The CI workflows (.github/workflows) call only what exists: every `make` target they (and
the scripts they run) name is a Makefile target, every script path is a file; the nightly GPU
workflow runs `make verify-gpu` on self-hosted runners of 1, 2, 4 and 8 GPUs with TP sizes
matched to the GPUs, uploads the reports even when the gate fails, and does not swallow the
failure; the CPU workflow runs `make test` on Python 3.11 for pushes and pull requests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml  # a dependency of transformers

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
_MAKE_CALL = re.compile(r"\bmake[ \t]+((?:[^\s;&|]+[ \t]*)+)")
_SCRIPT = re.compile(r"(?<![\w/$.{-])((?:\./)?(?:\.?[\w-]+/)+[\w.-]+\.?\w*)")
_GATE_RUNS = ("bundled-fp32", "bundled-bf16", "bundled-quantized-bf16", "realdims-bf16",
              "realdims-fp32")


def _load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _triggers(workflow: dict) -> dict:
    # YAML 1.1 reads the bare key `on` as the boolean true.
    return workflow.get("on", workflow.get(True)) or {}


def _steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def _run_lines(workflow: dict) -> list[str]:
    return [step["run"] for step in _steps(workflow) if "run" in step]


def _scripts(commands: list[str]) -> list[Path]:
    return [Path(p) for c in commands for p in _SCRIPT.findall(c)]


def _commands(workflow: dict) -> list[str]:
    """The workflow's run lines and the text of the scripts they run."""
    lines = _run_lines(workflow)
    return lines + [(ROOT / s).read_text() for s in _scripts(lines) if (ROOT / s).is_file()]


def _makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([\w./ -]+?)\s*:(?!=)", line)
        if match and not line.startswith(("\t", "#")):
            targets.update(match.group(1).split())
    return targets


def _make_targets(command: str) -> list[str]:
    """The targets of every `make ...` in a shell command (variables, options, comments and
    `${{ }}` expressions left out)."""
    command = re.sub(r"\$\{\{.*?\}\}", "EXPR", command)
    command = "\n".join(line for line in command.splitlines()
                        if not line.lstrip().startswith("#"))
    return [word for call in _MAKE_CALL.findall(command) for word in call.split()
            if "=" not in word and not word.startswith("-")]


def _dry_run_gate(*variables: str) -> str:
    proc = subprocess.run(["make", "-n", "verify-gpu", f"PYTHON={sys.executable}", *variables],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_makefile_parser_finds_targets_and_rejects_others():
    """The target parser finds the documented targets and no variable assignments."""
    targets = _makefile_targets()
    assert {"verify", "verify-gpu", "test", "golden", "lint"} <= targets, targets
    assert not {"TP", "GPUS", "PYTHON", "comma"} & targets, targets
    assert _make_targets("make verify-gpu GPUS=${{ matrix.gpus }} -k && make test\n"
                         "# make sure") == ["verify-gpu", "test"]
    assert _scripts(["bash bench/gpu_gate.sh out/ && .ci/run", "echo ${{ env.X }}"]) == [
        Path("bench/gpu_gate.sh"), Path(".ci/run")]


@pytest.mark.parametrize("name", ["ci.yml", "nightly-gpu.yml"])
def test_workflow_calls_only_existing_targets_and_scripts(name):
    """Every make target a workflow or a script it runs calls is in the Makefile; every
    script path it names exists."""
    targets, workflow = _makefile_targets(), _load(name)
    commands = _commands(workflow)
    assert commands, f"{name} runs nothing"
    for command in commands:
        for target in _make_targets(command):
            assert target in targets, f"{name}: `make {target}` is not a Makefile target"
    for script in _scripts(_run_lines(workflow)):
        assert (ROOT / script).is_file(), f"{name}: {script} does not exist"


def test_ci_runs_the_test_suite_on_pushes_and_pull_requests():
    """The CPU workflow runs on push and pull_request, on ubuntu with Python 3.11, and runs
    `make test` (through .ci/run, the CI entry point)."""
    workflow = _load("ci.yml")
    assert {"push", "pull_request"} <= set(_triggers(workflow))
    (job,) = workflow["jobs"].values()
    assert job["runs-on"].startswith("ubuntu")
    pythons = [s["with"]["python-version"] for s in job["steps"]
               if s.get("uses", "").startswith("actions/setup-python")]
    assert pythons == ["3.11"], pythons
    assert Path(".ci/run") in _scripts(_run_lines(workflow))
    assert any("test" in _make_targets(c) for c in _commands(workflow))


def test_nightly_gate_matrix_runners_reports_and_failure():
    """Scheduled and manual; a matrix over 1, 2, 4 and 8 GPUs picks a self-hosted runner by a
    label naming the GPU count and passes that count to `make verify-gpu`; reports are
    uploaded with actions/upload-artifact even after a failure; no step may swallow one."""
    workflow = _load("nightly-gpu.yml")
    triggers = _triggers(workflow)
    assert triggers["schedule"][0]["cron"] and "workflow_dispatch" in triggers
    (job,) = workflow["jobs"].values()
    assert job["strategy"]["matrix"]["gpus"] == [1, 2, 4, 8]
    assert job["strategy"]["fail-fast"] is False
    labels = job["runs-on"]
    assert "self-hosted" in labels and any("${{ matrix.gpus }}" in label for label in labels)
    gate = [c for c in _run_lines(workflow) if "verify-gpu" in _make_targets(c)]
    assert len(gate) == 1 and "GPUS=${{ matrix.gpus }}" in gate[0], gate
    uploads = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert len(uploads) == 1 and uploads[0]["if"] == "always()", uploads
    assert uploads[0]["with"]["path"] == "${{ env.REPORTS }}" and "REPORTS" in gate[0]
    assert not any(s.get("continue-on-error") for s in job["steps"])


@pytest.mark.parametrize("gpus, tp", [("1", "1"), ("2", "1,2"), ("4", "1,2,4"), ("8", "1,2,4,8")])
def test_verify_gpu_matches_tp_to_gpus(gpus, tp, tmp_path):
    """`make verify-gpu GPUS=N` runs the installed harness (`python -m freetoken_verify.cli`, no
    PYTHONPATH) at TP sizes up to N for each of the gate's five runs, each writing JSON,
    JUnit and markdown reports into REPORTS, and the GPU kernel tests (JUnit into REPORTS)."""
    commands = _dry_run_gate(f"GPUS={gpus}", f"REPORTS={tmp_path}", "REALDIMS=/rd")
    runs = [line for line in commands.splitlines() if " -m freetoken_verify.cli " in line]
    assert len(runs) == len(_GATE_RUNS), commands
    for name, line in zip(_GATE_RUNS, runs):
        assert f"--tp {tp} " in line and "--device cuda" in line, line
        for suffix in ("json", "xml", "md"):
            assert f"{tmp_path}/{name}.{suffix}" in line, (name, line)
    assert "PYTHONPATH" not in commands
    _assert_bf16_models(runs[1], runs[2])
    (kernels,) = [line for line in commands.splitlines() if " -m pytest " in line]
    # every GPU test of the tree (kernels, engine, loading), not one folder of them
    assert kernels.split(" -m gpu ")[1].split()[0] == "tests", kernels
    assert f"{tmp_path}/kernels-gpu.xml" in kernels, kernels


def _assert_bf16_models(live_run: str, stored_run: str) -> None:
    """The bf16 runs split the bundled cases: those HF runs live, and the quantized ones
    (ModelOpt, compressed-tensors and HF fp8 alike)."""
    from freetoken_verify.cases.catalogue import CASES

    for line, quantized in ((live_run, False), (stored_run, True)):
        models = re.findall(r"--model ([^\s\";]+)", line)[-1]
        want = ",".join(n for n, c in sorted(CASES.items()) if c.quantized == quantized)
        assert models == want, line


def test_verify_gpu_parts_and_explicit_tp(tmp_path):
    """PART=bundled leaves out the real-dimension runs and the GPU kernel tests, PART=kernels
    runs only those, DEVICE=cpu never runs them; TP on the command line wins over GPUS; a GPU
    count the matrix does not know is refused."""
    commands = _dry_run_gate("PART=bundled", "TP=2,8", f"REPORTS={tmp_path}")
    assert "realdims" not in commands and commands.count("--tp 2,8 ") == 3, commands
    assert " -m pytest " not in commands
    commands = _dry_run_gate("PART=kernels", f"REPORTS={tmp_path}")
    assert " -m pytest " in commands and " -m freetoken_verify.cli " not in commands, commands
    assert " -m pytest " not in _dry_run_gate("DEVICE=cpu", f"REPORTS={tmp_path}")
    proc = subprocess.run(["make", "-n", "verify-gpu", f"PYTHON={sys.executable}", "GPUS=3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "GPUS=3: expected 1, 2, 4 or 8" in proc.stderr


def test_the_gate_refuses_an_interpreter_without_torch(tmp_path):
    """`make verify-gpu PYTHON=...` with an interpreter that has no torch stops at set-up,
    naming it, and installs nothing (a plain install there would pull a CUDA torch)."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run(["make", "verify-gpu", f"PYTHON={python}", f"REPORTS={tmp_path}/r"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"PYTHON={python} cannot import torch" in proc.stderr, (
        proc.stdout + proc.stderr)
    assert not (tmp_path / "r").exists(), "the gate ran on an interpreter without torch"


def test_the_gate_checks_for_cuda_before_writing_anything(tmp_path):
    """DEVICE=cuda on a machine whose torch sees no GPU fails at once with one error line,
    before the 5 GB real-dimension checkpoint is written or any report is started."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = subprocess.run(["make", "verify-gpu", f"PYTHON={sys.executable}", "DEVICE=cuda",
                           f"REALDIMS={tmp_path}/realdims", f"REPORTS={tmp_path}/r"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "sees no CUDA device" in proc.stderr, proc.stderr
    assert not (tmp_path / "realdims").exists() and not (tmp_path / "r").exists()


def test_actionlint_knows_every_custom_runner_label():
    """Every label a job's `runs-on` names beyond `self-hosted` and `linux` (with the matrix
    expanded) matches a pattern of `.github/actionlint.yaml`, so actionlint does not flag the
    GPU runners' labels."""
    from fnmatch import fnmatch

    declared = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())
    patterns = declared["self-hosted-runner"]["labels"]
    for name in ("ci.yml", "nightly-gpu.yml"):
        for job in _load(name)["jobs"].values():
            runs_on = job["runs-on"]
            labels = [runs_on] if isinstance(runs_on, str) else list(runs_on)
            if "self-hosted" not in labels:
                continue
            for gpus in job.get("strategy", {}).get("matrix", {}).get("gpus", [None]):
                for label in labels:
                    label = label.replace("${{ matrix.gpus }}", str(gpus))
                    if label in ("self-hosted", "linux"):
                        continue
                    assert any(fnmatch(label, p) for p in patterns), (name, label, patterns)
