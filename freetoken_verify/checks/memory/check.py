"""memory: what loading costs each rank, measured while the engine loads.

(a) Every parameter and buffer owns its storage (`untyped_storage().nbytes()` equals its own
bytes) and none lies inside a memory-mapped checkpoint file: a `narrow()` view or a
safetensors tensor kept as a parameter pins the whole checkpoint tensor (safetensors hands out
tensors backed by a private mapping of the file).
(b) What the rank holds equals what it should hold, computed from the config, the checkpoint
headers and the engine settings (`memory_expected`: parameters, the KV cache of the LOCAL KV
heads, GatedDeltaNet conv and recurrent state of the local value heads), part by part; and the
split parts at TP=N are 1/N of TP=1's (padding aside).
(c) Peak anonymous host memory growth (file-backed pages excluded: reading maps the file) and,
on GPU, `max_memory_allocated` growth stay within a budget of the expected bytes plus what the
loader needs on the side: nothing on CPU (each shard is copied from the mapped file straight
into its parameter), the pinned staging rings on GPU; plus a slack of 16 MiB + 2%. A loader
that builds each shard before copying it overshoots by its largest shard, and the message
names the tensor being copied at the peak."""

from __future__ import annotations

import ctypes.util
import time

import torch

from freetoken.engine.core import graphs_allowed
from freetoken.loading.loader import default_threads, observe_loading
from freetoken.loading.staging import staging_bytes
from freetoken_verify.checks.base import CheckContext, make_result
from freetoken_verify.checks.engine_cache import build_engine, release_engine
from freetoken_verify.checks.memory.expected import (
    CONV_STATE,
    KV_CACHE,
    PARAMETERS,
    RECURRENT_STATE,
    Part,
    expected_parts,
)
from freetoken_verify.checks.memory.sampler import PeakSampler
from freetoken_verify.checks.shards.check import owns_storage
from freetoken_verify.report.formats import CheckResult

MiB = 1 << 20
SLACK_FIXED = 16 * MiB
SLACK_FRACTION = 0.02
SPLIT_TOLERANCE = 0.01
"""Split parts x tp may exceed TP=1's by their padding and this fraction."""


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    ranks = [r.value for r in ctx.runner.run(_measure, ctx.case.engine_args(ctx.options))]
    failures = [f for r in ranks for f in r["failures"]]
    metrics = {
        "peak_bytes": max(r["peak_host"] for r in ranks),
        "budget_bytes": max(r["budget_host"] for r in ranks),
        "expected_bytes": max(r["expected"] for r in ranks),
        "not_owned": sum(r["not_owned"] for r in ranks),
        "per_rank": [{k: v for k, v in r.items() if k != "failures"} for r in ranks],
    }
    if ranks[0]["peak_device"] is not None:
        metrics["peak_device_bytes"] = max(r["peak_device"] for r in ranks)
        metrics["budget_device_bytes"] = max(r["budget_device"] for r in ranks)
    status = "fail" if failures else "pass"
    message = f"{ctx.case.name} tp={ctx.tp}: {failures[0]}" if failures else ""
    return make_result("memory", ctx, start, status, metrics, message)


def _measure(rank_ctx, engine_args: dict) -> dict:
    """Runs on every rank: load the engine afresh under measurement."""

    release_engine(rank_ctx)
    _return_freed_memory()
    cuda = rank_ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        device_base = torch.cuda.memory_allocated()
    with PeakSampler() as host, observe_loading(host.copying):
        core = build_engine(rank_ctx, engine_args)
        if cuda:
            torch.cuda.synchronize()
    actual = _actual_parts(core)
    expected = expected_parts(engine_args["folder"], core.cfg, core.dtype, rank_ctx.rank,
                              rank_ctx.size, graphs=graphs_allowed(core.cfg, core.device))
    failures = (_ownership_failures(core, rank_ctx.rank) + _mmap_failures(core, rank_ctx.rank))
    not_owned = len(failures)
    failures += _parameter_failures(core, expected[PARAMETERS], rank_ctx.rank)
    failures += _expectation_failures(actual, expected, rank_ctx.rank, rank_ctx.size)
    weights = expected[PARAMETERS].nbytes + actual["buffers"]
    own = weights + sum(p.nbytes for n, p in expected.items() if n != PARAMETERS)
    transient = staging_bytes(default_threads(rank_ctx.size, gpu=True)) if cuda else 0
    measured = _host_budgets(host, weights, own, transient, cuda, rank_ctx.rank, failures)
    peak_device = budget_device = None
    if cuda:
        peak_device = torch.cuda.max_memory_allocated() - device_base
        budget_device = _with_slack(own)
        if peak_device > budget_device:
            failures.append(_over("GPU memory", "during load", rank_ctx.rank, peak_device,
                                  budget_device, own, 0))
    return {"rank": rank_ctx.rank, "expected": own, "transient": transient,
            "expected_parts": {n: p.nbytes for n, p in expected.items()}, "actual_parts": actual,
            "parameter_formats": expected[PARAMETERS].by_format,
            **measured, "peak_device": peak_device, "budget_device": budget_device,
            "not_owned": not_owned, "failures": failures}


def _host_budgets(host, weights: int, own: int, transient: int, cuda: bool, rank: int,
                  failures: list[str]) -> dict:
    """Host growth while copying weights against the parameters (the caches come later), and
    over the whole construction against everything; on GPU the host holds neither."""
    if cuda:
        weights = own = 0
    peak, load_peak = host.peak - host.base, host.load_peak - host.base
    budget, budget_load = _with_slack(own + transient), _with_slack(weights + transient)
    if load_peak > budget_load:
        failures.append(_over("host memory", "while copying weights", rank, load_peak,
                              budget_load, weights, transient, host.at_peak))
    elif peak > budget:
        failures.append(_over("host memory", "during load", rank, peak, budget, own, transient))
    return {"peak_host": peak, "budget_host": budget, "load_peak_host": load_peak,
            "budget_load_host": budget_load}


def _with_slack(nbytes: int) -> int:
    return nbytes + SLACK_FIXED + int(SLACK_FRACTION * nbytes)


def _return_freed_memory() -> None:
    """Hand memory freed by an earlier engine back to the OS (glibc), so this load's growth is
    measured from a clean base instead of hiding in reused heap."""

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _over(what, when, rank, peak, budget, own, transient, at_peak=()) -> str:
    during = f"; at the peak the loader was copying {', '.join(at_peak)}" if at_peak else ""
    return (f"rank {rank}: {what} grew {peak / MiB:.1f} MiB {when}, budget "
            f"{budget / MiB:.1f} MiB ({own / MiB:.1f} MiB own + {transient / MiB:.1f} MiB "
            f"transient + slack){during}")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _actual_parts(core) -> dict[str, int]:
    """What the engine allocated, by the parts `memory_expected` names."""

    linear = getattr(core.model, "linear_state_layers", list)()
    parts = {PARAMETERS: _nbytes(core.model.parameters()),
             "buffers": _nbytes(core.model.buffers()),
             KV_CACHE: _nbytes([getattr(core, "kv_cache", None)])}
    if linear:
        parts[CONV_STATE] = _nbytes(layer.conv_state for layer in linear)
        parts[RECURRENT_STATE] = _nbytes(layer.recurrent_state for layer in linear)
    return parts


def _parameter_failures(core, expected: Part, rank: int, shown: int = 3) -> list[str]:
    """Each engine parameter against the bytes the config gives it (a quantized layer that
    dequantized at load, or holds a scale of another shape, is named here): the first
    `shown` mismatches, and how many more."""
    params = dict(core.model.named_parameters())
    failures = []
    for name in sorted(set(params) | set(expected.by_param)):
        want, how = expected.by_param.get(name, (0, "no checkpoint tensor fills it"))
        p = params.get(name)
        got = 0 if p is None else p.numel() * p.element_size()
        if got == want:
            continue
        held = "no such parameter" if p is None else \
            f"{str(p.dtype).removeprefix('torch.')} {list(p.shape)}"
        failures.append(f"rank {rank}: parameter {name} is {got} bytes ({held}), expected "
                        f"{want} bytes from the config: {how}")
    if len(failures) > shown:
        failures = failures[:shown] + [f"rank {rank}: {len(failures) - shown} more parameters "
                                       "differ from the config's bytes"]
    return failures


def _expectation_failures(actual: dict, expected: dict, rank: int, size: int) -> list[str]:
    """Each part as computed from the config, and its split bytes 1/size of TP=1's."""
    failures = []
    for name, part in expected.items():
        got = actual.get(name, 0)
        if got != part.nbytes:
            failures.append(f"rank {rank}: {name} is {got} bytes ({got / MiB:.2f} MiB), "
                            f"expected {part.nbytes} bytes ({part.nbytes / MiB:.2f} MiB) from "
                            f"the config: {part.formula}")
        split = got - (part.nbytes - part.split_bytes)
        padding = part.split_bytes * size - part.split_tp1
        if part.split_bytes and abs(split * size - part.split_tp1) > (
                padding + SPLIT_TOLERANCE * part.split_tp1):
            failures.append(f"rank {rank}: {name} split across tp={size} ranks is "
                            f"{split * size / part.split_tp1:.2f}x TP=1's x 1/{size}, "
                            "expected 1.00x")
    return failures


def _tensors(core):
    yield from core.model.named_parameters()
    yield from core.model.named_buffers()


def _checkpoint_mappings() -> list[tuple[int, int, str]]:
    """Address ranges where safetensors files are memory-mapped in this process (Linux)."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[-1].endswith(".safetensors"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            found.append((lo, hi, fields[-1].rsplit("/", 1)[-1]))
    return found


def _mmap_failures(core, rank: int) -> list[str]:
    maps = _checkpoint_mappings()
    failures = []
    for name, t in _tensors(core):
        ptr = t.untyped_storage().data_ptr()
        hit = next((f for lo, hi, f in maps if lo <= ptr < hi), None)
        if hit is not None:
            failures.append(f"rank {rank}: {name} lives in the memory-mapped checkpoint "
                            f"file {hit}: it pins the mapping instead of owning its bytes")
    return failures


def _ownership_failures(core, rank: int) -> list[str]:
    failures, seen = [], {}
    for name, t in _tensors(core):
        storage = t.untyped_storage()
        if not owns_storage(t):
            failures.append(f"rank {rank}: {name} does not own its storage ({storage.nbytes()} "
                            f"bytes held for {t.numel() * t.element_size()} bytes of data: a "
                            "view pins its parent)")
        elif storage.data_ptr() in seen:
            failures.append(f"rank {rank}: {name} shares storage with {seen[storage.data_ptr()]}")
        seen[storage.data_ptr()] = name
    return failures
