"""A/B of the decode kernels' tile tables and of overlapped steps on one engine: the same
checkpoint, the same process and the same GPU, the arms alternated round by round (A B B A
...), so a slow spell of a shared machine hits every arm alike; lent GPUs drift by 10-20 %
between runs of `bench/engine_decode.py`, more than a table change moves a step.

    python3 bench/tile_ab.py --model FOLDER --arm old:GEMV.json:QUANT.json \
        --arm new:-:- [--batches 1,16] [--rounds 4] [--new-tokens 16] [--mb 2005.3]

An arm is `name:gemv_table:quant_table[:switches]`, each table a JSON file that the engine
reads (`FREETOKEN_GEMV_TABLE`, `FREETOKEN_QUANT_TABLE`) or `-` for the shipped one, and
switches a comma list of `no-overlap` (each step's tokens read before the next step is
launched, `EngineConfig.overlap_steps=False`), `no-moe-rows` (one token's routed experts on
the grouped kernels, `fused_moe.ROWS_AT_ONE_TOKEN`), `no-shared-rows` (one token's shared
expert and gate on their own launches, not inside the routed row kernels,
`fused_moe.SHARED_IN_ROWS`), `no-quant-fusions` (one token's quantized projections without
the input norm, the gate and the residual add, `quant_gemm.DECODE_FUSIONS`), `no-quant-norm`
(the same without the input norm only, `quant_gemm.DECODE_NORM`), `no-row-prefetch` (the
16-bit row kernel of a normed call loads each weight tile in its step, not a step ahead,
`gemv.ROW_PREFETCH`), `no-row-early` (the row kernels load the residual and the norm weight
where they are used, `gemv.ROW_EARLY`), `no-row-pdl` (the 16-bit row kernels launched
without programmatic dependent launch, `gemv.ROW_PDL`), `no-gnorm-launch-next` (the next
kernel launches once the gated norm has finished, `norm_rope.GATED_LAUNCH_NEXT`) and
`no-attn-fold` (the q/k norms and the output gate on launches of their own, not inside the
decode attention, `freetoken.layers.attention.FOLD_NORM_GATE`), all on otherwise;
`nvfp4-columns` (an NVFP4 LM head of up to 16 tokens on the tensor-core kernel with the
tokens as the mma's columns, `nvfp4_linear.COLUMNS`), off otherwise; and the
decode attention's launch (`paged_attention.DECODE`, the shipped one otherwise) changed by
`attn-before` (the launch before its options, `paged_attention.BEFORE`), `attn-4-warps`,
`attn-no-splits` (one program a sequence and KV head), `attn-stages1` (no pipelining) and
`attn-no-launch-next` (the next kernel launches once attention has finished). Before each
arm's run the tables are re-read and the decode graphs dropped, so they are captured again
with that arm's tiles. A run is one warm-up and `--repeats` timed pairs (one token, then
`--new-tokens`); the step time is their difference over the decode steps. Prints each
arm's median step over the rounds, every round's value, and with `--mb` (the bytes a step
reads, from `bench/engine_decode.py`) the share of the copy bandwidth measured here."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch
from _common import copy_bandwidth, int_list
from engine_decode import make_prompts, measure
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken import LLM, SamplingParams  # noqa: E402
from freetoken.kernels import (  # noqa: E402
    fused_moe,
    gemv,
    norm_rope,
    nvfp4_linear,
    paged_attention,
    quant_gemm,
)
from freetoken.layers import attention  # noqa: E402

TABLES = (("FREETOKEN_GEMV_TABLE", gemv), ("FREETOKEN_QUANT_TABLE", quant_gemm))


ATTENTION_SWITCHES = {"attn-before": dataclasses.asdict(paged_attention.BEFORE),
                      "attn-4-warps": dict(num_warps=4), "attn-no-splits": dict(splits=1),
                      "attn-stages1": dict(stages=1),
                      "attn-no-launch-next": dict(launch_next=False)}
SWITCHES = ("no-overlap", "no-moe-rows", "no-shared-rows", "no-quant-fusions",
            "no-quant-norm", "no-row-prefetch", "no-row-early", "no-row-pdl",
            "no-gnorm-launch-next", "no-attn-fold", "nvfp4-columns", *ATTENTION_SWITCHES)
SHIPPED_ATTENTION = paged_attention.DECODE


def parse_arm(text: str) -> tuple[str, tuple[str, str, frozenset]]:
    parts = text.split(":")
    switches = frozenset(filter(None, parts[3].split(","))) if len(parts) == 4 else frozenset()
    if len(parts) not in (3, 4) or not parts[0] or not switches <= set(SWITCHES):
        raise argparse.ArgumentTypeError(f"{text!r}: expected name:gemv_table:quant_table"
                                         f"[:switches] (- for the shipped table; switches "
                                         f"from {', '.join(SWITCHES)})")
    for path in parts[1:3]:
        if path != "-" and not Path(path).is_file():
            raise argparse.ArgumentTypeError(f"{text!r}: no table file {path}")
    return parts[0], (parts[1], parts[2], switches)


def use_arm(llm: LLM, arm: tuple[str, str, frozenset]) -> None:
    """Point the engine at the arm's tables and switches, and drop its decode graphs
    (captured again on use)."""
    *tables, switches = arm
    llm._core.set_overlap("no-overlap" not in switches)
    fused_moe.ROWS_AT_ONE_TOKEN = "no-moe-rows" not in switches
    fused_moe.SHARED_IN_ROWS = "no-shared-rows" not in switches
    quant_gemm.DECODE_FUSIONS = "no-quant-fusions" not in switches
    quant_gemm.DECODE_NORM = "no-quant-norm" not in switches
    gemv.ROW_PREFETCH = "no-row-prefetch" not in switches
    gemv.ROW_EARLY = "no-row-early" not in switches
    gemv.ROW_PDL = "no-row-pdl" not in switches
    norm_rope.GATED_LAUNCH_NEXT = "no-gnorm-launch-next" not in switches
    attention.FOLD_NORM_GATE = "no-attn-fold" not in switches
    nvfp4_linear.COLUMNS = "nvfp4-columns" in switches
    fields = {}
    for name in switches & set(ATTENTION_SWITCHES):
        fields.update(ATTENTION_SWITCHES[name])
    paged_attention.DECODE = dataclasses.replace(SHIPPED_ATTENTION, **fields)
    for path, (var, module) in zip(tables, TABLES):
        if path == "-":
            os.environ.pop(var, None)
        else:
            os.environ[var] = path
        module._table.cache_clear()
    if llm._core.graphs is not None:
        llm._core.graphs.drop()


def step_us(llm: LLM, prompts, new_tokens: int, repeats: int, what: str) -> float:
    def run(n):
        params = SamplingParams(max_tokens=n or new_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate(prompts, params)

    ttft, full, _ = measure(run, "cuda", repeats, what)
    return (full - ttft) / (new_tokens - 1) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--arm", type=parse_arm, action="append", required=True)
    p.add_argument("--batches", type=int_list, default=[1])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--mb", type=float, default=None, help="bytes a decode step reads, MB")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if len(args.arm) < 2 or args.rounds < 1 or args.new_tokens < 2:
        p.error("needs two arms or more, --rounds >= 1 and --new-tokens >= 2")
    arms = dict(args.arm)
    copy_gbs = copy_bandwidth()
    times = {(name, b): [] for name in arms for b in args.batches}
    with LLM(args.model, device="cuda", dtype="bfloat16", progress=False,
             max_num_seqs=max(16, *args.batches)) as llm:
        vocab = llm._core.model_config.vocab_size
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                use_arm(llm, arms[name])
                for b in args.batches:
                    prompts = make_prompts(b, args.prompt_len, vocab)
                    times[name, b].append(step_us(llm, prompts, args.new_tokens, args.repeats,
                                                  f"{name} batch={b} round {r}"))
                    print(f"round {r} {name} batch {b}: {times[name, b][-1]:.1f} us",
                          flush=True)
    rows = []
    for (name, b), ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(arm=name, batch=b, step_us=med,
                         pct_copy=(100 * args.mb * 1e6 / (med * 1e-6) / (copy_gbs * 1e9)
                                   if args.mb else None),
                         rounds=" ".join(f"{t:.0f}" for t in ts)))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth "
          f"{copy_gbs:.0f} GB/s; {args.model.name}, {args.rounds} rounds")
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
