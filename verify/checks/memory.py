"""memory: what loading costs each rank, measured while the engine loads.

(a) Every parameter and buffer owns its storage (`untyped_storage().nbytes()` equals its own
bytes) and none lies inside a memory-mapped checkpoint file: a `narrow()` view or a
safetensors tensor kept as a parameter pins the whole checkpoint tensor (safetensors hands out
tensors backed by a private mapping of the file). (b) Peak anonymous host memory growth
(file-backed pages excluded: reading maps the file) and, on GPU, `max_memory_allocated` growth
stay within a budget computed from the rank's own bytes: parameters + buffers, plus the
transient of loading (the largest checkpoint tensor, read whole, and its shard before it is
copied into place), plus the caches allocated with the engine (paged KV cache, linear-attention
state pool), plus a slack of 16 MiB + 5%."""

from __future__ import annotations

import threading
import time

import torch

from verify.checks import CheckContext
from verify.checks.shards import owns_storage
from verify.report import CheckResult

MiB = 1 << 20
SLACK_FIXED = 16 * MiB
SLACK_FRACTION = 0.05


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
    return CheckResult("memory", ctx.case.name, ctx.tp, status, time.monotonic() - start,
                       ctx.placement, metrics, message)


class _PeakSampler:
    """Samples this process's anonymous resident memory (RSS minus file-backed pages)."""

    def __init__(self, period: float = 0.002):
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self.now()
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def now(self) -> int:
        info = self._proc.memory_info()
        return info.rss - info.shared

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self._period)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _measure(rank_ctx, engine_args: dict) -> dict:
    """Runs on every rank: load the engine afresh under measurement."""
    from verify.engine import build_engine, release_engine

    release_engine(rank_ctx)
    _return_freed_memory()
    cuda = rank_ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        device_base = torch.cuda.memory_allocated()
    with _PeakSampler() as host:
        core = build_engine(rank_ctx, engine_args)
        if cuda:
            torch.cuda.synchronize()
    own = _weight_bytes(core) + _cache_bytes(core)
    largest = _largest_tensor_bytes(engine_args)
    transient = largest + largest // rank_ctx.size
    failures = _ownership_failures(core, rank_ctx.rank) + _mmap_failures(core, rank_ctx.rank)
    not_owned = len(failures)
    peak_host = host.peak - host.base
    budget_host = (0 if cuda else own) + transient
    budget_host += SLACK_FIXED + int(SLACK_FRACTION * budget_host)
    peak_device = budget_device = None
    if cuda:
        peak_device = torch.cuda.max_memory_allocated() - device_base
        budget_device = own + SLACK_FIXED + int(SLACK_FRACTION * own)
        if peak_device > budget_device:
            failures.append(_over("GPU memory", rank_ctx.rank, peak_device, budget_device, own, 0))
    if peak_host > budget_host:
        failures.append(_over("host memory", rank_ctx.rank, peak_host, budget_host,
                              0 if cuda else own, transient))
    return {"rank": rank_ctx.rank, "expected": own, "transient": transient,
            "peak_host": peak_host, "budget_host": budget_host, "peak_device": peak_device,
            "budget_device": budget_device, "not_owned": not_owned, "failures": failures}


def _return_freed_memory() -> None:
    """Hand memory freed by an earlier engine back to the OS (glibc), so this load's growth is
    measured from a clean base instead of hiding in reused heap."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _over(what, rank, peak, budget, own, transient) -> str:
    return (f"rank {rank}: {what} grew {peak / MiB:.1f} MiB during load, budget "
            f"{budget / MiB:.1f} MiB ({own / MiB:.1f} MiB own + {transient / MiB:.1f} MiB "
            f"transient + slack)")


def _tensors(core):
    yield from core.model.named_parameters()
    yield from core.model.named_buffers()


def _weight_bytes(core) -> int:
    return sum(t.numel() * t.element_size() for _, t in _tensors(core))


def _cache_bytes(core) -> int:
    """The paged KV cache and any per-sequence linear-attention state."""
    caches = [getattr(core, "kv_cache", None)]
    for layer in getattr(core.model, "linear_state_layers", list)():
        caches += [layer.conv_state, layer.recurrent_state]
    return sum(t.numel() * t.element_size() for t in caches if t is not None)


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


def _largest_tensor_bytes(engine_args: dict) -> int:
    """Bytes of the largest checkpoint tensor, from the safetensors headers alone."""
    import math

    from freetoken.loading import CheckpointReader

    reader = CheckpointReader(engine_args["folder"], engine_args["num_layers"])
    sizes = []
    for name in reader.names():
        shape, dtype = reader.meta(name)
        sizes.append(math.prod(shape) * _DTYPE_BYTES.get(dtype, 4))
    reader.close()
    return max(sizes, default=0)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
