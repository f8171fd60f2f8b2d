"""The README's examples run as a user pastes them: every Python block as a script (the
engine and the harness at TP 2, which needs the `__main__` guard the blocks carry), the
pytest block as a user's test file, and every `freetoken` command of the engine section. A
README edit that breaks an example, or drops the guard, fails here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(README.read_text()) if lang == language]


def _scripts() -> list[str]:
    """The Python blocks that are scripts (the pytest example is a test file)."""
    return [b for b in _blocks("python") if "def test_" not in b]


def _engine_commands() -> list[str]:
    """`freetoken generate` / `freetoken plan` lines of the bash blocks, comments dropped."""
    lines = [line.split("  #")[0].strip() for b in _blocks("bash") for line in b.splitlines()]
    return [line for line in lines if line.startswith(".venv/bin/freetoken ")]


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _assert_clean(proc: subprocess.CompletedProcess, label: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{label} exited {proc.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"{label} printed a traceback:\n{out[-3000:]}"


def test_the_readme_has_the_examples_this_file_runs():
    """The parsers find the blocks (a README reshuffle must not turn this file into a no-op)."""
    assert len(_scripts()) >= 2 and len(_engine_commands()) >= 3, (_scripts(), _engine_commands())
    assert all('if __name__ == "__main__":' in s for s in _scripts()), "a script lacks the guard"


@pytest.mark.parametrize("index", range(len(_scripts())))
def test_python_example_runs_as_a_script(index, tmp_path):
    """The block, saved as a script and run from the checkout root, exits 0 without a
    traceback (TP 2: the ranks' fork server imports the script again)."""
    script = tmp_path / f"example_{index}.py"
    script.write_text(_scripts()[index])
    _assert_clean(_run([sys.executable, str(script)], ROOT), f"README Python block {index}")


def test_pytest_example_is_collected_and_skips_with_its_reason(tmp_path):
    """The fixture example, as a user's test file, is collected by the plugin and skipped on a
    machine with fewer GPUs than its marker asks for, with the reason shown."""
    block = next(b for b in _blocks("python") if "def test_" in b)
    (tmp_path / "test_user.py").write_text(block)
    proc = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                 "test_user.py"], tmp_path)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 and "1 passed" in out:
        return
    assert proc.returncode == 0 and "1 skipped" in out and "CUDA" in out, out[-3000:]


@pytest.mark.parametrize("command", _engine_commands())
def test_engine_command_runs(command):
    """Each `freetoken ...` line of the engine section exits 0 from the checkout root."""
    args = shlex.split(command)
    args[0] = str(Path(sys.executable).parent / "freetoken")
    _assert_clean(_run(args, ROOT), command)
