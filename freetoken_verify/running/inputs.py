"""Input checks that run before any rank starts: report paths, checkpoint files (headers
only) and the bundled cases' weights against the hashes their `meta.json` records. Each
failure is a one-line `InputError` naming the path or tensor."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path

from freetoken.distributed import choose_placement
from freetoken.engine.core import resolve_dtype
from freetoken.loading.checkpoint import CheckpointError
from freetoken.loading.screen import screen_checkpoint
from freetoken.loading.validate import validate_checkpoint
from freetoken_verify.cases.catalogue import weights_sha256
from freetoken_verify.errors import InputError, UsageError
from freetoken_verify.reference.prompts import PromptError, check_lengths
from freetoken_verify.reference.sources import (
    custom_prompts,
    live_hf_reference,
    reference_source,
    requested_prompts,
    stored_dir,
)
from freetoken_verify.reference.store import StoreError, check_store, check_writable, save_reference
from freetoken_verify.reference.twin import TwinError


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"))


def check_report_path(option: str, value: str) -> Path:
    """`value` can be written after the run: absent or a regular file (reports are replaced
    atomically by a rename, which would put a plain file in place of a device, a pipe or a
    socket: `--report-json /dev/stdout` as root would replace the system's node), its nearest
    existing ancestor a folder we can create files in (probed with a real temporary file:
    permission bits lie to root and on read-only mounts)."""
    if not value.strip():
        raise InputError(f"{option}: empty path")
    path = Path(value).expanduser().absolute()
    if path.exists():
        mode = path.stat().st_mode
        kind = next((name for test, name in _KINDS if test(mode)), None)
        if kind is not None:
            raise InputError(f"{option}: {path} is {kind}; reports are written only to "
                             "regular files")
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


def check_report_paths(report_json: str | None, junit_xml: str | None,
                       summary_md: str | None = None) -> None:
    """Every report path writable and no two of them the same file."""
    paths = {opt: check_report_path(opt, v) for opt, v in
             (("--report-json", report_json), ("--junit-xml", junit_xml),
              ("--summary-md", summary_md)) if v is not None}
    seen: dict[Path, str] = {}
    for option, path in paths.items():
        if path.resolve() in seen:
            raise InputError(f"{seen[path.resolve()]} and {option} are the same file {path}: "
                             "one would overwrite the other")
        seen[path.resolve()] = option


def check_case_files(case) -> None:
    """The case's checkpoint headers and index, its tensors' dtypes against its quantization
    config; for a bundled case, its weights' sha256 against meta.json (a modified bundled
    case is bad input, not an engine bug)."""
    try:
        validate_checkpoint(case.folder)
        # float8 / uint8 weights the quantization config does not declare (a float8
        # checkpoint that lost its config otherwise loads and passes golden against HF).
        screen_checkpoint(case.folder, case.model_config.quantization)
    except (CheckpointError, OSError) as e:
        raise InputError(f"{case.name}: {e}") from None
    if case.bundled:
        _check_bundled_hashes(case)


def _check_bundled_hashes(case) -> None:
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


def check_reference_options(cases, options) -> None:
    """The reference options fit the models: prompts that tokenize and fit each model, a
    saved reference (`--reference DIR`) that matches the checkpoint, a `--save-reference`
    folder that can receive one. Runs before any rank starts (it hashes the weights)."""

    saving, reusing = options.save_reference, stored_dir(options) and not options.save_reference
    if saving and options.reference not in ("auto", "hf"):
        raise UsageError(f"--save-reference computes HF's reference; it cannot be "
                         f"combined with --reference {options.reference}")
    if (saving or reusing) and len(cases) != 1:
        option = "--save-reference" if saving else "--reference DIR"
        raise UsageError(f"{option} holds one model's reference; give exactly one --model "
                         f"(got {len(cases)})")
    try:
        for case in cases:
            source = reference_source(case, options)
            if source == "golden" and custom_prompts(options):
                raise UsageError(f"{case.name}: the stored golden covers its own prompts; "
                                 "--prompts-file, --seed and --max-new-tokens need "
                                 "--reference hf or a saved reference")
            if saving:
                check_writable(saving)
            requested = requested_prompts(case, options) if source != "golden" else None
            if reusing:
                dtype = resolve_dtype(options.dtype, case.model_config)
                asked = (requested[0] if options.prompts_file or options.seed is not None
                         else None, options.max_new_tokens)
                meta = check_store(options.reference, case, options, asked, dtype)
                requested = (meta["prompts"], meta["num_greedy"])
            if requested is not None:
                check_lengths(*requested, case)
    except (PromptError, StoreError) as e:
        raise InputError(str(e)) from None


def save_references(cases, tp_sizes, options) -> None:
    """`--save-reference DIR`: compute HF's reference once, before any rank starts (HF's model
    is freed before the engine loads), on the device rank 0 of the first TP size uses."""
    if not options.save_reference:
        return

    device = choose_placement(options.device, tp_sizes[0], options.oversubscribe).device_for(0)
    print(f"{cases[0].name}: computing HF's reference into {options.save_reference}",
          file=sys.stderr)
    try:
        ref = live_hf_reference(cases[0], options, device, with_bisect=True)
    except TwinError as e:  # the quantized checkpoint's dequantized twin, not HF
        raise InputError(str(e)) from None
    except Exception as e:  # HF failing on this checkpoint: one line, as any bad input
        # HF's own OSErrors (a checkpoint it cannot find or load) are HF's, not the folder's.
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"{cases[0].name}: HF transformers could not compute the "
                         f"reference ({type(e).__name__}: {first})") from None
    try:
        save_reference(ref, cases[0], options, device, options.save_reference)
    except OSError as e:
        raise InputError(f"--save-reference: cannot write {options.save_reference} "
                         f"({e.strerror or e})") from None
