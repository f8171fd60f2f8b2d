"""Checkpoint load time and peak memory per rank: the engine's loader against the old
shard-then-copy path and against views copied into place, on CPU or GPU.

    .venv/bin/python bench/load.py [--case llama,qwen35-bf16,qwen35-nvfp4] [--tp 1,2,4]
        [--layers N] [--dtype float32|bfloat16] [--modes fast,clone,view,view-held]
        [--device cpu|cuda] [--repeat N] [--model FOLDER]

Checkpoints (`bench/load_checkpoints.py`): the Llama (default; 2.17 GiB at 10 layers in fp32)
and Qwen3.6-35B-A3B's text dimensions with bf16 or NVFP4 experts (`--layers` layers, 2 by
default for them), written with safetensors into a temporary folder as several files with an
index, read once to warm the page cache, and deleted at the end.

Method. For each case, TP size and mode a fresh rank group is started (`cpu-gloo`, or
`cuda-nccl` with rank r on cuda:r) and every rank builds `EngineCore(folder, model_config,
EngineConfig(progress=False, num_kv_blocks=1), device)` at the same time (the config parsed
before the clock starts). Per rank:

* `load_s`: wall time of the construction (model build + load + a one-block KV cache);
  `GB/s`: the rank's parameter bytes over it; `weights_s`: the weight loading alone
  (`load_weights`, until every transfer has landed); `plan_s`: its planning pass (every name
  resolved to its rule and slot and checked before the first copy);
* `peak_rss` / `peak_anon`: growth over the rank's RSS just before the load, sampled every
  20 ms with `psutil` (`anon` = RSS minus file-backed and shared pages: memory only this
  rank holds; the rest is mapped checkpoint pages, shared page cache); `after_rss`: RSS
  growth once the constructor has returned; `local`: the rank's parameter bytes;
* on GPU: `gpu/expected`, `max_memory_allocated` growth over the bytes the memory check
  expects from the config (parameters, KV cache, GatedDeltaNet state, buffers); `h2d_GB/s`,
  the pinned host-to-device bandwidth measured in the same rank right after the load (512 MiB
  copies, median of 5), and `%h2d`, the load rate as a share of it (`%h2d_weights`: the
  same for `weights_s`).

Modes (monkeypatched inside each rank process):

* `fast`: the engine as is: each shard copied once from the mapped file into its parameter
  (on GPU through pinned staging buffers), threads over runs of tensors;
* `fast-mmap`: as `fast`, but GPU staging buffers are filled by copying from the mapped
  views (page faults on the mapping) instead of reading the file (no difference on CPU);
* `clone`: the old path (`freetoken_verify.faults.double_copy_load`): each shard built as a fresh
  tensor, then copied into the parameter (on GPU from pageable memory);
* `view`: as `clone`, but shards are `narrow()` views of the full tensor (replicated: the
  tensor itself; the spec modules' `fresh` returns its input), so the copy into the
  parameter is the only one: views copied into place, one tensor at a time;
* `view-held`: as `view`, and every shard is kept alive until the load ends.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from _common import cpu_name, h2d_bandwidth, int_list
from load_checkpoints import CASES, warm_page_cache, write
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.distributed import Placement, RankGroup  # noqa: E402
from freetoken.distributed.launch import RankError  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("fast", "fast-mmap", "clone", "view", "view-held")
DEFAULT_LAYERS = {"llama": 10, "qwen35-bf16": 2, "qwen35-nvfp4": 2}
SAMPLE_S = 0.02
MIB = 2**20
H2D_BYTES = 512 * MIB

_HELD: list[torch.Tensor] = []


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [m.strip() for m in text.split(",") if m.strip()]
        bad = [m for m in items if m not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", type=_choices(CASES), default=["llama"],
                   help=f"comma-separated subset of {','.join(CASES)} (default llama)")
    p.add_argument("--tp", type=int_list, default=[1, 2, 4], help="TP sizes (default 1,2,4)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 10 for llama, 2 for qwen35)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="checkpoint and engine dtype (default float32 llama, bfloat16 qwen35)")
    p.add_argument("--modes", type=_choices(MODES), default=["fast", "clone", "view"],
                   help=f"comma-separated subset of {','.join(MODES)} (default fast,clone,view)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the modes this many times, interleaved (default 1)")
    p.add_argument("--model", type=Path, default=None,
                   help="an existing checkpoint folder instead of a generated one")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp):
        p.error(f"--device cuda needs {max(args.tp)} GPUs, {torch.cuda.device_count()} visible")
    return args


# --- rank functions (module level: pickled to the rank processes) ----------------------------


def _use_mode(ctx, mode: str) -> None:
    """Switch the loader to `mode`'s path in this rank process."""
    from freetoken.formats import specs
    from freetoken.formats.nvfp4 import specs as nvfp4_specs
    from freetoken_verify.faults.memory import double_copy_load

    if mode == "fast":
        return
    if mode == "fast-mmap":
        _stage_from_mapping()
        return
    double_copy_load()
    if mode == "clone":
        return
    hold = mode == "view-held"

    def view(t):
        if hold:
            _HELD.append(t)
        return t

    # Every fresh copy a spec makes (Split, Heads, Replicate, PaddedSplit, the NVFP4 specs)
    # becomes the view: the name each spec module calls.
    for module in (specs, nvfp4_specs):
        module.fresh = view
    _HELD.clear()


def _stage_from_mapping() -> None:
    """GPU staging fills its buffers from the mapped views only (no file reads)."""
    from freetoken.loading import staging

    def fill(stage, pieces, first, stop, files, origin):
        for region, source in staging._row_pieces(pieces, first, stop, stage):
            region.zero_() if source is None else region.copy_(source)

    staging.fill = fill


def _sample_memory(proc: psutil.Process, stop: threading.Event, peak: dict) -> None:
    while True:
        m = proc.memory_info()
        peak["rss"] = max(peak["rss"], m.rss)
        peak["anon"] = max(peak["anon"], m.rss - m.shared)
        if stop.wait(SAMPLE_S):
            return


def _measure_load(ctx, folder: str, dtype: str) -> dict:
    from freetoken.config import EngineConfig
    from freetoken.engine.core import EngineCore
    from freetoken.models.registry import load_config

    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.zeros(1, device=ctx.device)
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        gpu_base = torch.cuda.memory_allocated(ctx.device)
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info()
    peak = {"rss": before.rss, "anon": before.rss - before.shared}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_memory, args=(proc, stop, peak), daemon=True)
    sampler.start()
    model_config = load_config(folder)
    cfg = EngineConfig(dtype=dtype, progress=False, num_kv_blocks=1)
    parts = _time_load_parts()
    t0 = time.perf_counter()
    core = EngineCore(folder, model_config, cfg, ctx.device)
    if cuda:
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    after = proc.memory_info()
    peak_rss, peak_anon = max(peak["rss"], after.rss), max(peak["anon"], after.rss - after.shared)
    local = sum(p.nbytes for p in core.model.parameters())
    _HELD.clear()
    out = {"load_s": seconds, "weights_s": parts["weights"], "plan_s": parts["plan"],
           "peak_rss": peak_rss - before.rss,
           "peak_anon": peak_anon - (before.rss - before.shared),
           "after_rss": after.rss - before.rss, "local": local}
    if cuda:
        out["gpu"] = torch.cuda.max_memory_allocated(ctx.device) - gpu_base
        out["expected"] = _expected_bytes(folder, core, ctx)
        del core
        out["h2d"] = h2d_bandwidth(ctx.device, H2D_BYTES)
    return out


def _time_load_parts() -> dict:
    """Wrap the engine's `load_weights` (the weights alone, every transfer landed) and the
    loader's planning pass (names resolved, shards checked, nothing copied) with timers."""
    import freetoken.engine.core as core
    from freetoken.loading import loader

    parts = {"weights": 0.0, "plan": 0.0}

    def timed(key, fn, sync):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                parts[key] += time.perf_counter() - t0
        return run

    core.load_weights = timed("weights", core.load_weights, True)
    loader._plan = timed("plan", loader._plan, False)
    return parts


def _expected_bytes(folder: str, core, ctx) -> int:
    """What the rank should hold, from the config (the memory check's computation)."""
    from freetoken.engine.core import graphs_allowed
    from freetoken_verify.checks.memory.expected import expected_parts

    parts = expected_parts(folder, core.cfg, core.dtype, ctx.rank, ctx.size,
                           graphs=graphs_allowed(core.cfg, core.device))
    return sum(p.nbytes for p in parts.values()) + sum(b.nbytes for b in core.model.buffers())


# --- driver --------------------------------------------------------------------------------


def run_one(folder: Path, tp: int, mode: str, dtype: str, device: str) -> list[dict]:
    placement = Placement("cuda-nccl", torch.cuda.device_count()) if device == "cuda" \
        else Placement("cpu-gloo")
    with RankGroup(tp, placement, timeout=600.0) as group:
        group.run(_use_mode, mode)
        return group.run(_measure_load, str(folder), dtype)


def machine(device: str) -> str:
    import safetensors

    ram = psutil.virtual_memory().total / 2**30
    gpu = f", {torch.cuda.get_device_name(0)}" if device == "cuda" else ""
    return (f"machine: {platform.machine()} {cpu_name()}, os.cpu_count()={os.cpu_count()}, "
            f"{ram:.0f} GiB RAM{gpu}, torch {torch.__version__}, "
            f"safetensors {safetensors.__version__}")


def row(case: str, tp: int, mode: str, rank: int, r: dict, cuda: bool) -> list:
    rate = r["local"] / r["load_s"] / 1e9
    cells = [case, tp, mode, rank, r["load_s"], r["weights_s"], r["plan_s"], rate,
             r["peak_rss"] / MIB, r["peak_anon"] / MIB, r["after_rss"] / MIB, r["local"] / MIB,
             r["peak_anon"] / r["local"]]
    if cuda:
        weights_rate = r["local"] / r["weights_s"] / 1e9
        cells += [r["gpu"] / r["expected"], r["h2d"], 100 * rate / r["h2d"],
                  100 * weights_rate / r["h2d"]]
    return cells


def bench_case(case: str, args, tmp: str, rows: list, began: float) -> str:
    dtype = args.dtype or ("float32" if case == "llama" else "bfloat16")
    layers = args.layers or DEFAULT_LAYERS[case]
    folder = args.model or Path(tmp) / case
    if args.model is None:
        size = write(folder, case, layers, DTYPES[dtype])
        # Written pages still being flushed to disk would slow whichever mode runs first.
        os.sync()
        print(f"{case}: wrote {size / 2**30:.2f} GiB in {time.perf_counter() - began:.0f}s",
              file=sys.stderr)
    size = warm_page_cache(folder)
    for tp in args.tp:
        for mode in args.modes * args.repeat:
            try:
                results = run_one(folder, tp, mode, dtype, args.device)
            except RankError as e:
                # One mode failing should not cost the others' numbers: report it, go on.
                print(f"{case} tp={tp} {mode}: FAILED: {e}", file=sys.stderr)
                continue
            for rank, r in enumerate(results):
                rows.append(row(case, tp, mode, rank, r, args.device == "cuda"))
            print(f"{case} tp={tp} {mode}: done ({time.perf_counter() - began:.0f}s)",
                  file=sys.stderr)
    label = str(args.model) if args.model else f"generated {case}, {layers} layers"
    return f"{label}: {size / 2**30:.2f} GiB of {dtype} safetensors files (page cache warm)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, labels = [], []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="freetoken-bench-load-") as tmp:
        for case in args.case:
            labels.append(bench_case(case, args, tmp, rows, began))
            if args.model is None:
                for file in (Path(tmp) / case).glob("*"):
                    file.unlink()
    print(machine(args.device))
    for label in labels:
        print(f"checkpoint: {label}")
    print("MiB of growth over each rank's RSS just before the load; anon = RSS minus "
          "file-backed and shared pages; GB/s = parameter bytes / load_s")
    print()
    headers = ["case", "tp", "mode", "rank", "load_s", "weights_s", "plan_s", "GB/s",
               "peak_rss_MiB", "peak_anon_MiB", "after_rss_MiB", "local_MiB", "anon/local"]
    fmt = ["", "", "", "", ".2f", ".2f", ".2f", ".2f", ".0f", ".0f", ".0f", ".0f", ".2f"]
    if args.device == "cuda":
        headers += ["gpu/expected", "h2d_GB/s", "%h2d", "%h2d_weights"]
        fmt += [".3f", ".1f", ".0f", ".0f"]
    print(tabulate(rows, headers=headers, floatfmt=fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
