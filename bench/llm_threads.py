"""Throughput of one `LLM` shared by several threads, against the same requests made one call
after another and as one batched call.

    .venv/bin/python bench/llm_threads.py [--model FOLDER] [--tp 1,2] [--threads 8]
        [--new-tokens 32] [--repeats 3]

Each of `threads` callers asks for one prompt of 8 tokens and `new_tokens` greedy tokens (EOS
ignored). Three ways, each warmed up once and then timed `repeats` times (median):

* `serial`: the callers one after another from one thread (`threads` calls of one prompt);
* `threads`: every caller in its own thread, all released at once (their calls share the
  continuous batch);
* `one call`: one `generate` of all `threads` prompts (the batching ceiling).

Printed: seconds and generated tokens per second of each, per TP size. Without `--model` the
bundled `tiny-qwen3-moe` case runs on the CPU."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from freetoken import LLM, SamplingParams

_BUNDLED = Path(__file__).resolve().parent.parent / "freetoken_verify" / "golden" / "tiny-qwen3-moe"


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * k + j) % 200 + 1 for j in range(8)] for k in range(n)]


def _serial(llm: LLM, prompts, params) -> None:
    for prompt in prompts:
        llm.generate([prompt], params)


def _threads(llm: LLM, prompts, params) -> None:
    start = threading.Barrier(len(prompts))

    def call(prompt):
        start.wait()
        llm.generate([prompt], params)

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _one_call(llm: LLM, prompts, params) -> None:
    llm.generate(prompts, params)


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(_BUNDLED))
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    prompts = _prompts(args.threads)
    tokens = args.threads * args.new_tokens
    print(f"{'tp':>3} {'way':>9} {'seconds':>8} {'tok/s':>8}")
    for tp in [int(t) for t in args.tp.split(",")]:
        with LLM(args.model, tp=tp, device=args.device, progress=False) as llm:
            for name, way in (("serial", _serial), ("threads", _threads),
                              ("one call", _one_call)):
                seconds = _median_seconds(lambda w=way: w(llm, prompts, params), args.repeats)
                print(f"{tp:>3} {name:>9} {seconds:>8.3f} {tokens / seconds:>8.0f}")


if __name__ == "__main__":
    main()
