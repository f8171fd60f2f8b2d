"""Where a graphed decode step's time goes: GPU kernel time per step (torch profiler, CUPTI
sees the kernels of a graph replay) by kernel name, against the wall time per step.

    python3 bench/profile_decode.py --model FOLDER [--batch 1] [--steps 16] [--top 15]

Kernel time summed over the profiled steps and divided by their number; `wall` is the
decode time per step of the same run (host work included), so wall - GPU is what the host
and the gaps between kernels cost."""

from __future__ import annotations

import argparse
import sys
import time
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
    args = p.parse_args()
    prompts = [[3 + i] * 32 for i in range(args.batch)]
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
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time)
    # The profiled run also prefills once; per step is over the decode steps.
    rows = sorted(((name[:70], len(t), sum(t)) for name, t in kernels.items()),
                  key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"{args.model} batch {args.batch}: wall {wall * 1e6:.0f} us/step, GPU kernels "
          f"{total / (args.steps + 1):.0f} us/step (prefill spread over the steps), "
          f"{sum(r[1] for r in rows) / (args.steps + 1):.0f} kernels/step")
    print(tabulate([(n, c, t / (args.steps + 1)) for n, c, t in rows[: args.top]],
                   headers=["kernel", "calls", "us/step"], floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
