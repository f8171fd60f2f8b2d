"""Build hook: the wheel and the sdist carry the git commit they were built from
(`freetoken/_build_info.py`), so an installed package's reports and `--version` name the
code they ran. Everything else about the package is in pyproject.toml."""

from __future__ import annotations

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

BUILD_INFO = Path("freetoken") / "_build_info.py"
# What the package is built from: a change elsewhere in the checkout does not make it dirty.
PACKAGE_PATHS = ("freetoken", "freetoken_verify", "pyproject.toml", "setup.py")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip()


def _build_info() -> str | None:
    """The module's text, or None outside a git checkout (a build from an sdist keeps the
    file the sdist carries)."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", *PACKAGE_PATHS)
    dirty = None if status is None else bool(status)
    return ('"""Written by setup.py at build time: the commit this package was built from."""\n'
            f"COMMIT = {commit!r}\nDIRTY = {dirty!r}\n")


def _write(root: Path) -> None:
    text = _build_info()
    if text is not None:
        (root / BUILD_INFO).write_text(text)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            _write(Path(self.build_lib))


class SDist(sdist):
    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        _write(Path(base_dir))


setup(cmdclass={"build_py": BuildPy, "sdist": SDist})
