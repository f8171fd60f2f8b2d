"""Decode throughput of the FreeToken engine against HF transformers on the same model.

    .venv/bin/python bench/engine_decode.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--tp 1,2] [--batches 1,8] [--prompt-len 32] [--new-tokens 32] [--graphs on,off]
        [--tp-invariant on,off]
        [--size small|medium|qwen3.5-moe-realdims [--layers N] [--format F] | --model FOLDER]
        [--repeats 3] [--threads N]

Without `--model` a checkpoint is generated with HF transformers itself (random init under a
fixed seed, `save_pretrained` into a temporary folder): a Llama (`small` or `medium`, its
preset's depth or `--layers` layers) or `qwen3.5-moe-realdims` (Qwen3.6-35B-A3B's text
dimensions, `--layers` layers, default 2, bf16, built on the device;
`_engine_bytes.write_qwen_realdims`), in bf16 or, with `--format`, converted to a shipping
quantized layout (`fp8-block`, `nvfp4-ct`, `modelopt-mixed`:
`freetoken_verify.cases.realdims`, quantized on the device); HF then runs on the bf16
master (a speed reference: its greedy tokens are not expected to match, so `match` is `-`).
Two runs at two depths give the per-layer cost (their step times' difference over the
layers' difference) without the LM head.

On CUDA the engine runs with decode CUDA graphs (`graphs on`) and without (`off`, the
`enforce_eager` engine option), each as its own rows; the graph capture time and memory of
each `on` engine are printed below the table. For the in-process engine (TP 1) on CUDA the
table also gives the bytes a decode step must read (`MB/step`: every weight but the
embedding table, the routed experts actually hit, counted by hooks in one extra eager run,
the cached keys and values and the linear-attention states; `_engine_bytes.step_bytes`),
that over the measured step time (`GB/s`), and that against the device-to-device copy
bandwidth measured in the same run (`% copy`, read + write bytes per second of a 1 GiB copy).

`--tp-invariant on` runs the engine in the `tp_invariant` mode (canonical TP-split sums) as
rows of their own; `x default` is an invariant row's step time over the step time
of the default-mode row with the same TP size, graphs and batch.

Method. Each configuration gets a batch of `batch` random prompts of exactly `prompt_len`
tokens (same prompts for the engine and for HF, so HF needs no padding) and generates
`new_tokens` tokens greedily with EOS ignored:

* FreeToken: `LLM.generate(prompts, SamplingParams(max_tokens=N, temperature=0,
  ignore_eos=True))`.
* HF: `model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False,
  eos_token_id=None, pad_token_id=0)` under `torch.inference_mode()`.

Time to first token (TTFT) is measured by a separate run of the same prompts with one new
token (`max_tokens=1` / `max_new_tokens=1`): that run is the prefill plus one sampling.
The full run is `new_tokens` tokens, i.e. the same prefill plus `new_tokens - 1` decode steps,
so

    decode tok/s = batch * (new_tokens - 1) / (t_full - t_ttft)

Each of the two runs is warmed up once and then timed three times (`--repeats`), the TTFT and
full runs interleaved; the medians are used. A warning goes to stderr when a measurement's
slowest run is over 1.5x its fastest, and at the start when the load average says other
processes are busy (on a shared CPU machine: rerun when it is quiet, or raise `--repeats`). On
CUDA the device is synchronised around every timed run. Both sides run in this process with
the same `torch.get_num_threads()` at TP=1; TP>1 ranks are separate processes, each of which
the engine pins to one intra-op thread.

The `match` column checks that the engine's greedy tokens equal HF's (at every batch size,
every sequence), so the speed comparison is of equivalent work; it is meant for float32 (in
bfloat16 the near-flat logits of a randomly initialised model can tip greedy picks either way,
so `no` there is not by itself a bug). The last column is the engine's decode tok/s divided by
HF's at the same batch size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import copy_bandwidth, int_list
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_bytes import experts_hit, step_bytes, write_qwen_realdims  # noqa: E402
from _engine_report import machine, table  # noqa: E402

from freetoken import LLM, SamplingParams  # noqa: E402
from freetoken_verify.cases.realdims import FORMATS as REALDIMS_FORMATS  # noqa: E402
from freetoken_verify.cases.realdims import quantize_checkpoint  # noqa: E402

PRESETS = {
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=1536, vocab_size=8192),
    "medium": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, intermediate_size=2816, vocab_size=32000),
}
REALDIMS = "qwen3.5-moe-realdims"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NOISY = 1.5  # warn when the slowest timed run exceeds the fastest by this factor
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--tp", type=int_list, default=[1], help="TP sizes, e.g. 1,2 (default 1)")
    p.add_argument("--batches", type=int_list, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--size", choices=[*PRESETS, REALDIMS], default="small",
                   help="preset of the generated checkpoint (ignored with --model)")
    p.add_argument("--keep-model", type=Path, default=None,
                   help="write the generated checkpoint here (reused when it exists)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers of the generated checkpoint (default: {REALDIMS} 2, "
                        "the Llama presets their own)")
    p.add_argument("--format", choices=REALDIMS_FORMATS, default="bf16",
                   help=f"layout of the generated {REALDIMS} checkpoint (default bf16)")
    p.add_argument("--graphs", type=lambda t: [v.strip() for v in t.split(",")], default=None,
                   help="engine decode CUDA graphs: on, off or on,off (default on,off on "
                        "cuda, off on cpu)")
    p.add_argument("--tp-invariant", dest="invariant", type=_on_off, default=["off"],
                   help="engine tp_invariant mode: on, off or on,off (default off)")
    p.add_argument("--model", type=Path, default=None,
                   help="an existing Llama-family checkpoint folder instead of a generated one")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads in this process (default: torch's choice)")
    args = p.parse_args(argv)
    if args.prompt_len < 1:
        p.error("--prompt-len must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode needs at least one step after the first)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")
    if args.graphs is None:
        args.graphs = ["on", "off"] if args.device == "cuda" else ["off"]
    if not set(args.graphs) <= {"on", "off"}:
        p.error("--graphs takes on, off or on,off")
    if args.format != "bf16" and (args.size != REALDIMS or args.model is not None):
        p.error(f"--format converts the generated {REALDIMS} checkpoint only")
    return args


def _on_off(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",")]
    if not values or not set(values) <= {"on", "off"}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected on, off or on,off")
    return values


def make_checkpoint(size: str, folder: Path, args) -> Path:
    """A randomly initialised model saved by HF transformers: a Llama in float32 weights, or
    qwen3.5-moe-realdims in bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size == REALDIMS:
        return write_qwen_realdims(folder, args.layers or 2, args.device)
    config = LlamaConfig(**llama_preset(size, args.layers), max_position_embeddings=2048,
                         rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return folder


def make_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED + batch)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen)
    return ids.tolist()


def timed(fn: Callable[[], object], device: str) -> tuple[float, object]:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def measure(run: Callable[[int | None], object], device: str, repeats: int, what: str
            ) -> tuple[float, float, object]:
    """(median TTFT s, median full-run s, tokens of the last full run). `run(1)` generates one
    new token, `run(None)` all of them; both are warmed up once, then timed `repeats` times,
    interleaved so a slow spell of the machine hits both alike. Warns on a noisy spread."""
    run(1)
    run(None)
    ttfts, fulls, tokens = [], [], None
    for _ in range(repeats):
        seconds, _ = timed(lambda: run(1), device)
        ttfts.append(seconds)
        seconds, tokens = timed(lambda: run(None), device)
        fulls.append(seconds)
    for name, times in (("ttft", ttfts), ("full", fulls)):
        if max(times) > NOISY * min(times):
            print(f"warning: {what}: noisy {name} timings "
                  f"({', '.join(f'{t * 1e3:.0f}' for t in times)} ms)", file=sys.stderr)
    return statistics.median(ttfts), statistics.median(fulls), tokens


def bench_hf(folder: Path, args, prompts: dict[int, list[list[int]]]) -> dict[int, dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype])
    model = model.to(args.device).eval()
    # greedy and length-bound only: no EOS stopping, no EOS suppression, no sampling defaults
    model.generation_config.eos_token_id = None
    results = {}
    for batch, ps in prompts.items():
        ids = torch.tensor(ps, device=args.device)

        def run(n, ids=ids):
            n = n or args.new_tokens
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            return out[:, ids.shape[1]:].cpu().tolist()

        ttft, full, tokens = measure(run, args.device, args.repeats, f"hf batch={batch}")
        results[batch] = dict(ttft=ttft, full=full, tokens=tokens)
    return results


def bench_engine(folder: Path, tp: int, graphs: str, invariant: str, args,
                 prompts: dict[int, list[list[int]]]) -> tuple[dict[int, dict], str]:
    """Per batch: timings, tokens and (TP 1 on CUDA) the bytes a decode step reads; and a
    line on graph capture."""
    results, capture = {}, ""
    with LLM(folder, tp=tp, device=args.device, dtype=args.dtype, progress=False,
             max_num_seqs=max(16, *prompts), enforce_eager=graphs == "off",
             tp_invariant=invariant == "on") as llm:
        for batch, ps in prompts.items():

            def run(n, ps=ps):
                params = SamplingParams(max_tokens=n or args.new_tokens, temperature=0.0,
                                        ignore_eos=True)
                return [r.token_ids for r in llm.generate(ps, params)]

            ttft, full, tokens = measure(run, args.device, args.repeats,
                                         f"engine tp={tp} graphs={graphs} "
                                         f"invariant={invariant} batch={batch}")
            results[batch] = dict(ttft=ttft, full=full, tokens=tokens, bytes=None)
            if args.device == "cuda" and llm._core is not None:
                hit = experts_hit(llm, ps, args.new_tokens)
                context = args.prompt_len + args.new_tokens // 2
                results[batch]["bytes"] = step_bytes(llm, batch, context, hit)
        core = llm._core
        if core is not None and core.graphs is not None:
            g = core.graphs
            capture = (f"engine tp={tp}: captured {len(g.graphs)} decode graphs (batch "
                       f"buckets {sorted(g.graphs)}) in {g.capture_seconds:.2f} s, "
                       f"{g.capture_bytes / 2**20:.0f} MiB of GPU memory")
    return results, capture


def checkpoint(args, tmp: str) -> tuple[Path, str, Path]:
    """The checkpoint folder, its label and the folder HF runs: --model, else generated (into
    --keep-model when given, reused from there when it already holds one); with --format,
    the bf16 master converted next to it, HF running the master."""
    if args.model is not None:
        return args.model, str(args.model), args.model
    folder = args.keep_model or Path(tmp) / args.size
    # Beside the folder, named by size and depth, so runs of several formats share it.
    master = folder if args.format == "bf16" else \
        folder.parent / f"{args.size}-{args.layers or 2}-layers.bf16"
    if not (master / "config.json").is_file():
        make_checkpoint(args.size, master, args)
    if args.format != "bf16" and not (folder / "config.json").is_file():
        quantize_checkpoint(master, folder, args.format, device=args.device)
    if args.size == REALDIMS:
        return folder, (f"generated {REALDIMS} ({args.layers or 2} layers, HF init, "
                        f"{args.format})"), master
    return folder, f"generated Llama ({args.size}: " + ", ".join(
        f"{k}={v}" for k, v in llama_preset(args.size, args.layers).items()) + ")", folder


def llama_preset(size: str, layers: int | None) -> dict:
    """The preset's Llama config, with `layers` decoder layers when given."""
    preset = dict(PRESETS[size])
    if layers is not None:
        preset["num_hidden_layers"] = layers
    return preset


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: other "
              "processes are running, timings will be noisy", file=sys.stderr)
    copy_gbs = copy_bandwidth() if args.device == "cuda" else None
    with tempfile.TemporaryDirectory(prefix="freetoken-bench-") as tmp:
        folder, label, hf_folder = checkpoint(args, tmp)
        from freetoken.models.registry import load_config

        vocab = load_config(folder).vocab_size
        prompts = {b: make_prompts(b, args.prompt_len, vocab) for b in args.batches}

        hf = bench_hf(hf_folder, args, prompts)
        engine = {(tp, g, inv): bench_engine(folder, tp, g, inv, args, prompts)
                  for tp in args.tp for g in args.graphs for inv in args.invariant}

    print(machine(args))
    print(f"model: {label}, dtype {args.dtype}")
    print(f"decode tok/s = batch*(new_tokens-1) / (t_full - t_ttft); medians of {args.repeats} "
          "timed runs after one warm-up")
    if copy_gbs:
        print(f"copy bandwidth (1 GiB device-to-device, read + write): {copy_gbs:.0f} GB/s")
    print()
    print(tabulate(table(args, hf, engine, copy_gbs),
                   headers=["impl", "tp", "graphs", "invariant", "batch", "prompt_len",
                            "new_tokens", "ttft_ms", "decode_tok_s", "match", "engine/hf",
                            "step_us", "x default", "MB/step", "GB/s", "% copy"],
                   floatfmt=".1f", disable_numparse=False))
    for _, capture in engine.values():
        if capture:
            print(capture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
