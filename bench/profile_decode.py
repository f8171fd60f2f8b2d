"""Where a graphed decode step's time goes: GPU kernel time per step (torch profiler, CUPTI
sees the kernels of a graph replay) by kernel name, against the wall time per step, and
with `--timeline` one decode step's kernels in launch order with the idle gap before each.

    python3 bench/profile_decode.py --model FOLDER [--batch 1] [--steps 16] [--top 15]
        [--timeline]

Kernel time summed over the profiled steps and divided by their number; `wall` is the
decode time per step of the same run (host work included), so wall - GPU is what the host
and the gaps between kernels cost. The timeline cuts the kernel stream into steps at the
step's last kernel: the kernel name that runs once per step (as often as there are steps,
the prefill's included) with the most time, the LM head."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken import LLM, SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--timeline", action="store_true",
                   help="print one decode step's kernels in order, with the gaps between them")
    args = p.parse_args()
    # Random prompts, as engine_decode's: repeating one token would route every sequence to
    # the same experts and hide the batch's expert bytes.
    gen = torch.Generator().manual_seed(args.batch)
    prompts = torch.randint(3, 1000, (args.batch, 32), generator=gen).tolist()
    with LLM(args.model, device="cuda", dtype="bfloat16", progress=False,
             max_num_seqs=max(16, args.batch)) as llm:
        def run(n):
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

        run(args.steps + 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        run(args.steps + 1)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t1 - (t1 - t0)) / args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(args.steps + 1)
            torch.cuda.synchronize()
    launches = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels: dict[str, list[float]] = {}
    for start, end, name in launches:
        kernels.setdefault(name, []).append(end - start)
    # The profiled run also prefills once; per step is over the decode steps.
    rows = sorted(((name[:70], len(t), sum(t)) for name, t in kernels.items()),
                  key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"{args.model} batch {args.batch}: wall {wall * 1e6:.0f} us/step, GPU kernels "
          f"{total / (args.steps + 1):.0f} us/step (prefill spread over the steps), "
          f"{sum(r[1] for r in rows) / (args.steps + 1):.0f} kernels/step")
    print(tabulate([(n, c, t / (args.steps + 1)) for n, c, t in rows[: args.top]],
                   headers=["kernel", "calls", "us/step"], floatfmt=".1f"))
    if args.timeline:
        print_timeline(launches, args.steps + 1)
    return 0


def step_kernels(launches: list[tuple[float, float, str]], steps: int
                 ) -> list[tuple[float, float, str]]:
    """The kernels of one decode step from the middle of the run: the stream between two
    runs of the kernel that ends each step (once per step, the most time)."""
    counts = Counter(name for _, _, name in launches)
    time_of = Counter()
    for start, end, name in launches:
        time_of[name] += end - start
    once = [n for n, c in counts.items() if c in (steps, steps - 1)]
    if not once:
        return []
    last = max(once, key=lambda n: time_of[n])
    ends = [i for i, (_, _, name) in enumerate(launches) if name == last]
    middle = len(ends) // 2
    # The previous step's last kernel too: the gap after it is the host's share of a step.
    return launches[ends[middle - 1]: ends[middle] + 1]


def print_timeline(launches: list[tuple[float, float, str]], steps: int) -> None:
    step = step_kernels(launches, steps)
    if not step:
        print("timeline: no kernel runs once per step; cannot cut the stream into steps")
        return
    host_gap = step[1][0] - step[0][1]
    step = step[1:]
    rows, previous_end, busy, idle = [], None, 0.0, 0.0
    for start, end, name in step:
        gap = 0.0 if previous_end is None else start - previous_end
        rows.append((name[:80], end - start, gap))
        busy += end - start
        idle += max(gap, 0.0)
        previous_end = end
    print(f"\none decode step: {len(step)} kernels, {busy:.1f} us busy, {idle:.1f} us idle "
          f"between them, {step[-1][1] - step[0][0]:.1f} us first start to last end; "
          f"{host_gap:.1f} us from the previous step's last kernel to this step's first "
          f"(the host's step: sampling, scheduling, the input copies)")
    print(tabulate(rows, headers=["kernel", "us", "gap_us"], floatfmt=".1f"))


if __name__ == "__main__":
    sys.exit(main())
