"""Which code is running: the package version and the git commit, read from the checkout the
package was imported from, else from what the build recorded (`freetoken/_build_info.py`,
written by setup.py into wheels and sdists). What cannot be found is None, never an error."""

from __future__ import annotations

import importlib
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

_PROBE_TIMEOUT = 5.0
ROOT = Path(__file__).resolve().parents[1]
"""The checkout root when the package is imported from one (it holds `.git`)."""


def package_version(name: str = "freetoken") -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def command_output(args: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a short command, stripped; None if it is missing, fails or hangs."""
    try:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip()


def git_state(root: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) of the checkout at `root` (default:
    the one this package was imported from); (None, None) without `.git` there (an installed
    package: a virtual environment inside some other repository must not report that
    repository's commit), or when git is missing or fails."""
    root = ROOT if root is None else root
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None, None
    commit = command_output(["git", "rev-parse", "HEAD"], cwd=root)
    if not commit:
        return None, None
    status = command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return commit, None if status is None else bool(status)


def build_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) the installed build recorded; (None, None) if it recorded none."""
    try:  # written into wheels and sdists at build time, absent in a checkout
        build_info = importlib.import_module(f"{__package__}._build_info")
    except ImportError:
        return None, None
    return getattr(build_info, "COMMIT", None), getattr(build_info, "DIRTY", None)


def code_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the running code: the checkout's, else the build's."""
    commit, dirty = git_state()
    return (commit, dirty) if commit else build_state()


def describe(program: str) -> str:
    """`program VERSION (commit C[, modified])`, what `--version` prints."""
    version = package_version() or "unknown (not installed; run `pip install -e .`)"
    commit, dirty = code_state()
    if not commit:
        return f"{program} {version}"
    return f"{program} {version} (commit {commit[:12]}{', modified' if dirty else ''})"
