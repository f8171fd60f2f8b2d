"""The identity of a run, for its report: what it ran on (`environment`), what was asked
(`run_identity`) and where each model came from (`model_entry`). Everything here is cheap
and runs in the parent before any rank starts; what cannot be found is None, never an error:
a report must still be written."""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed

from freetoken.distributed import choose_placement
from freetoken.version import code_state, command_output, package_version
from freetoken_verify.reference.sources import reference_source, stored_dir
from freetoken_verify.reference.store import read_meta
from freetoken_verify.reference.twin import planned_twin

# A folder of the Hugging Face hub cache: `.../models--Org--Name/snapshots/<commit hash>`.
_HUB_SNAPSHOT = re.compile(r"^models--(?P<repo>.+)$")
_DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class RunInfo:
    """What a report says about its run besides the results (report version 2): `env`,
    `run` and one entry per model, as JSON-ready dicts."""

    env: dict
    run: dict
    models: list[dict]


def utc_now() -> str:
    """The current time, ISO 8601 in UTC to the second: `2026-12-01T14:35:24Z`."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dtype_label(dtype: str) -> str:
    """`bf16` for bfloat16, `fp32`, `fp16`; other names unchanged."""
    return _DTYPE_LABELS.get(dtype, dtype)


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux: what the platform module knows
        return platform.processor() or None
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _nccl_version(torch) -> str | None:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return None
    try:
        version = torch.cuda.nccl.version()
    except RuntimeError:  # the library is built in but cannot be loaded here
        return None
    # A (major, minor, patch) tuple; older torch returned one integer (2708 for 2.7.8).
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def environment(device: str) -> dict:
    """The software and hardware a report was produced with; `device` is where ranks ran
    (`cpu` or `cuda`). Package versions come from metadata (importing triton without a GPU
    driver can fail or take seconds); CUDA facts only when a GPU is visible (reading the GPU
    names starts CUDA in this process, as the live HF reference does anyway; ranks start from
    a fresh forkserver, so this is safe)."""

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    nccl = _nccl_version(torch) if cuda else None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "torch": package_version("torch"), "triton": package_version("triton"),
            "transformers": package_version("transformers"), "cuda": torch.version.cuda,
            "nccl": nccl, "driver": _driver_version() if cuda else None, "device": device,
            "gpus": gpus, "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "cpu": _cpu_model(), "cpu_count": os.cpu_count()}


def hub_source(folder: Path) -> dict:
    """Where a checkpoint folder came from: its path and, for a snapshot in the Hugging Face
    hub cache (`models--Org--Name/snapshots/<hash>`), the hub id, the snapshot hash and the
    ref (`main`, a tag) that points at it, if any; those are None otherwise."""
    folder = Path(folder)
    source = {"path": str(folder.resolve()), "hub_id": None, "revision": None, "snapshot": None}
    repo = folder.parent.parent
    match = _HUB_SNAPSHOT.match(repo.name)
    if folder.parent.name != "snapshots" or match is None:
        return source
    source["hub_id"] = match["repo"].replace("--", "/")
    source["snapshot"] = folder.name
    refs = repo / "refs"
    for ref in sorted(refs.rglob("*")) if refs.is_dir() else ():
        if ref.is_file() and ref.read_text(encoding="utf-8").strip() == folder.name:
            source["revision"] = ref.relative_to(refs).as_posix()
            break
    return source


def model_entry(case, options) -> dict:
    """One model of the run: name, whether it is bundled, the dtype the engine runs it at,
    its reference, the dequantized twin HF runs on for a quantized checkpoint (`twin_entry`)
    and its source (what model resolution recorded on `case.source` over what the folder's
    path says)."""

    dtype = options.dtype if options.dtype != "auto" else case.model_config.dtype
    reference = reference_source(case, options)
    return {"name": case.name, "bundled": case.bundled, "dtype": str(dtype),
            "reference": reference, "twin": twin_entry(case, options, reference),
            "source": {**hub_source(case.folder), **(case.source or {})}}


def twin_entry(case, options, reference: str) -> dict | None:
    """The dequantized twin a quantized checkpoint's HF reference runs (or, saved, ran) on:
    key, path, dtype, depth, and for a live one whether it was cached when the run started;
    None for an unquantized checkpoint, a stored golden, or a twin that cannot be read."""
    try:
        if reference == "hf":
            return planned_twin(case, options.num_layers)
        if reference == "stored":
            return read_meta(stored_dir(options)).get("twin")
    except (OSError, ValueError):
        return None
    return None


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def run_identity(plan, started: str) -> dict:
    """What was asked and of which code: the resolved arguments (models, TP sizes, checks,
    faults and every verify option), the process's command line, the version and checkout."""
    options = {k: _plain(v) for k, v in asdict(plan.options).items()}
    arguments = {"models": [c.name for c in plan.cases], "tp": list(plan.tp_sizes),
                 "checks": list(plan.checks), "faults": list(plan.faults), **options}
    commit, dirty = code_state()
    return {"arguments": arguments, "argv": list(sys.argv), "dtype": plan.options.dtype,
            "device": plan.options.device, "reference": plan.options.reference,
            "faults": list(plan.faults), "seed": options.get("seed"), "started": started,
            "finished": None, "version": package_version("freetoken"), "git_commit": commit,
            "git_dirty": dirty}


def describe_run(plan) -> RunInfo:
    """The run identity of `plan`, taken when the run starts."""

    started = utc_now()
    placements = [choose_placement(plan.options.device, tp, plan.options.oversubscribe)
                  for tp in plan.tp_sizes]
    device = "cuda" if any(p.is_cuda for p in placements) else "cpu"
    return RunInfo(environment(device), run_identity(plan, started),
                   [model_entry(case, plan.options) for case in plan.cases])


def describe_refused_run(plan_args: dict, error: Exception) -> RunInfo:
    """The identity of a run refused before it could start (`plan_args`: `build_plan`'s
    keywords as given; `error`: why): what was asked, on which code and machine, and no
    models (none was resolved), so that its reports still say what happened."""
    started = utc_now()
    device = plan_args.get("device")
    env = environment(device if device in ("cpu", "cuda") else
                      ("cuda" if torch.cuda.is_available() else "cpu"))
    arguments = {k: _plain(v) for k, v in plan_args.items() if k != "only"}
    commit, dirty = code_state()
    run = {"arguments": arguments, "argv": list(sys.argv),
           "dtype": _plain(plan_args.get("dtype", "auto")),
           "device": _plain(device or "auto"), "reference": _plain(plan_args.get("reference",
                                                                              "auto")),
           "faults": _plain(list(plan_args.get("faults") or ())),
           "seed": plan_args.get("seed") if isinstance(plan_args.get("seed"), int) else None,
           "started": started, "finished": started, "version": package_version("freetoken"),
           "git_commit": commit, "git_dirty": dirty}
    return RunInfo(env, run, [])
