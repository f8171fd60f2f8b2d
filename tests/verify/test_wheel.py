"""The harness as a user installs it: a wheel built from this checkout, installed into a fresh
virtual environment, verifies a bundled case from a directory outside the checkout.

No downloads: the wheel is built without build isolation and installed without dependencies;
the fresh environment sees the test interpreter's site-packages (torch, transformers, ...)
through a `.pth` file, which adds those folders without running their own `.pth` files, so an
editable install of this checkout there stays inactive."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a wheel is built from; copied so the build leaves nothing behind in the checkout.
_SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in", "freetoken",
            "freetoken_verify")


def _make_wheel(tmp_path: Path) -> Path:
    source, out = tmp_path / "source", tmp_path / "wheels"
    source.mkdir()
    for name in _SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    # The copy is built as the checkout would be: setup.py reads the commit through git.
    git = {"GIT_DIR": str(ROOT / ".git"), "GIT_WORK_TREE": str(source)}
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "-q", "-w", str(out), str(source)], "pip wheel", git)
    wheels = list(out.glob("freetoken-*.whl"))
    assert len(wheels) == 1, f"pip wheel wrote {wheels}"
    return wheels[0]


def _make_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)], "venv")
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     tmp_path).stdout.strip())
    dependencies = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")
    _check([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
            "--no-index", "-q", str(wheel)], "pip install")
    return venv


def _clean_env() -> dict[str, str]:
    """The environment without anything that would put the checkout on sys.path."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def _check(args: list[str], label: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{label} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def _assert_imports_from(venv: Path, cwd: Path) -> None:
    probe = ("import json, sys, freetoken_verify, freetoken; "
             "print(json.dumps([freetoken_verify.__file__, freetoken.__file__, sys.path]))")
    proc = _run([str(venv / "bin" / "python"), "-c", probe], cwd)
    assert proc.returncode == 0, proc.stderr
    verify_file, freetoken_file, path = json.loads(proc.stdout)
    for label, module in (("freetoken_verify", verify_file), ("freetoken", freetoken_file)):
        assert Path(module).resolve().is_relative_to(venv.resolve()), (
            f"{label} imported from {module}, not from the fresh venv {venv}")
    entries = {Path(p or cwd).resolve() for p in path}
    assert ROOT not in entries, f"the checkout {ROOT} is on the subprocess's sys.path: {path}"


def test_wheel_verifies_bundled_case_outside_the_checkout(tmp_path):
    """The wheel carries the bundled cases: installed into a fresh venv, `freetoken-verify
    --reference golden --tp 1,2 --checks golden,shards` on tiny-llama, run from an unrelated
    directory with the checkout off sys.path, exits 0 and reports the installed package (its
    version, the commit it was built from, the case read from the venv)."""
    wheel = _make_wheel(tmp_path)
    wheel_version = wheel.name.split("-")[1]
    venv = _make_venv(tmp_path, wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    _assert_imports_from(venv, work)
    proc = _run([str(venv / "bin" / "freetoken-verify"), "--model", "tiny-llama", "--tp", "1,2",
                 "--checks", "golden,shards", "--reference", "golden", "--device", "cpu",
                 "--report-json", "report.json"], work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "4 passed, 0 failed, 0 skipped", proc.stdout
    report = json.loads((work / "report.json").read_text())
    assert report["complete"] is True and report["summary"]["passed"] == 4, report["summary"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert report["run"]["version"] == wheel_version and report["run"]["git_commit"] == head, (
        report["run"])
    version = _run([str(venv / "bin" / "freetoken"), "--version"], work)
    assert version.returncode == 0 and f"(commit {head[:12]}" in version.stdout, version
    (model,) = report["models"]
    assert Path(model["source"]["path"]).resolve().is_relative_to(venv.resolve()), model
    assert model["reference"] == "golden", model
