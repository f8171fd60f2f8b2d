"""Input checks that run before any rank starts: report paths, checkpoint files (headers
only) and the bundled cases' weights against the hashes their `meta.json` records. Each
failure is a one-line `InputError` naming the path or tensor."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from freetoken.loading.checkpoint import CheckpointError
from freetoken.loading.validate import validate_checkpoint
from verify.errors import InputError


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_report_path(option: str, value: str) -> Path:
    """`value` can be written after the run: not a folder, its nearest existing ancestor a
    folder we can create files in (probed with a real temporary file: permission bits lie to
    root and on read-only mounts)."""
    if not value.strip():
        raise InputError(f"{option}: empty path")
    path = Path(value).expanduser().absolute()
    if path.is_dir():
        raise InputError(f"{option}: {path} is a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{option}: {path} is not writable")
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise InputError(f"{option}: cannot create {path}: {base} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise InputError(f"{option}: cannot write under {base} ({e.strerror})") from None
    return path


def check_report_paths(report_json: str | None, junit_xml: str | None) -> None:
    """Both report paths writable and, when both are given, distinct."""
    paths = {opt: check_report_path(opt, v) for opt, v in
             (("--report-json", report_json), ("--junit-xml", junit_xml)) if v is not None}
    if len(paths) == 2 and paths["--report-json"].resolve() == paths["--junit-xml"].resolve():
        raise InputError(f"--report-json and --junit-xml are the same file "
                         f"{paths['--junit-xml']}: one would overwrite the other")


def check_case_files(case) -> None:
    """The case's checkpoint headers and index; for a bundled case, its weights' sha256
    against meta.json (a modified bundled case is bad input, not an engine bug)."""
    try:
        validate_checkpoint(case.folder)
    except (CheckpointError, OSError) as e:
        raise InputError(f"{case.name}: {e}") from None
    if case.bundled:
        _check_bundled_hashes(case)


def _check_bundled_hashes(case) -> None:
    from verify.cases import weights_sha256

    meta_path = case.folder / "meta.json"
    try:
        recorded = json.loads(meta_path.read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{case.name}: {meta_path} has no usable weights_sha256 "
                         f"({type(e).__name__}: {e}); run `make golden`") from None
    actual = weights_sha256(case.folder)
    for name in sorted(set(recorded) | set(actual)):
        if recorded.get(name) != actual.get(name):
            raise InputError(
                f"{case.name}: {case.folder / name} does not match the sha256 in {meta_path} "
                "(the bundled case was modified; restore it with git or run `make golden`)")
