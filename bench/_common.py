"""Helpers the benchmark scripts share."""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cpu_name() -> str:
    """platform.processor(), or the model name from /proc/cpuinfo where that is empty."""
    name = platform.processor()
    if not name or name == platform.machine():
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return name or "?"


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of one eager `fn()` on the current CUDA stream (CUDA events)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, read + write bytes per second."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src), reps) / 1e6


def h2d_bandwidth(device, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Pinned host-to-device copy bandwidth in GB/s (median of `reps` copies after one)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return nbytes / statistics.median(times[1:]) / 1e6


def capture_graph(fns: list):
    """One CUDA graph that calls each of `fns` once, in order, after one warm-up pass of them
    on a side stream (what capture needs: allocations and lazy initialisation done)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def graph_us(calls: list, replays: int = 5) -> float:
    """Microseconds per call of `calls` (closures) captured once each into one CUDA graph."""
    import torch

    graph = capture_graph(calls)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def rel_l2(got, want) -> float:
    """Relative L2 distance of two tensors, in float32."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))

