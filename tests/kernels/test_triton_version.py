"""The triton requirement in pyproject.toml has an upper bound, and admits the installed triton
and the versions the kernels are checked on (3.6 on the GPU machine, 3.8 on the CPU ones):
kernels written against one Triton's language are not assumed to compile on the next."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

CHECKED_VERSIONS = ("3.6.0", "3.8.0")


def _make_triton_requirement():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = [requirements.Requirement(d) for d in deps if d.startswith("triton")]
    assert len(found) == 1, f"pyproject.toml: expected one triton requirement, got {found}"
    return found[0]


def _assert_admits(requirement, version: str, what: str) -> None:
    assert requirement.specifier.contains(version, prereleases=True), (
        f"{what} triton {version} is outside pyproject.toml's {requirement}")


def test_triton_requirement_is_bounded_above():
    """The declared range ends below some version (`<` or `<=`)."""
    requirement = _make_triton_requirement()
    uppers = [s for s in requirement.specifier if s.operator in ("<", "<=", "==", "~=")]
    assert uppers, f"pyproject.toml: {requirement} has no upper bound"


@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_checked_triton_versions_are_admitted(version):
    """Every triton the kernels are checked on satisfies the declared range."""
    _assert_admits(_make_triton_requirement(), version, "checked")


def test_installed_triton_is_admitted():
    """The triton this process would run satisfies the declared range."""
    try:
        installed = metadata.version("triton")
    except metadata.PackageNotFoundError:
        pytest.skip("triton is not installed")
    _assert_admits(_make_triton_requirement(), installed, "installed")
