"""The table `engine_decode.py` prints: decode speed, engine / HF, bytes per step against
the copy bandwidth."""

from __future__ import annotations

import math
import os
import platform

import torch
from _common import cpu_name


def decode_tok_s(r: dict, batch: int, new_tokens: int) -> float:
    """NaN when the timings are too noisy to leave a positive decode time."""
    decode = r["full"] - r["ttft"]
    return batch * (new_tokens - 1) / decode if decode > 0 else float("nan")


def ratio(engine: float, hf: float) -> str:
    value = engine / hf
    return f"{value:.1f}x" if math.isfinite(value) else "n/a"


def match(engine_rows: list[list[int]], hf_rows: list[list[int]]) -> str:
    """`yes` when every sequence's greedy tokens equal HF's; else where the first differs."""
    if engine_rows == hf_rows:
        return "yes"
    bad = [i for i, (e, h) in enumerate(zip(engine_rows, hf_rows, strict=True)) if e != h]
    e, h = engine_rows[bad[0]], hf_rows[bad[0]]
    first = next((i for i, (a, b) in enumerate(zip(e, h, strict=False)) if a != b),
                 min(len(e), len(h)))
    where = (f"token {first}" if len(engine_rows) == 1
             else f"{len(bad)} seqs, seq {bad[0]} token {first}")
    return f"no ({where})"


def machine(args) -> str:
    lines = [
        f"machine: {platform.machine()} {cpu_name()}, "
        f"os.cpu_count()={os.cpu_count()}, torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}",
        f"device: {args.device}"
        + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else ""),
    ]
    return "\n".join(lines)


def table(args, hf, engine, copy_gbs) -> list[list]:
    rows = []
    for batch in args.batches:
        h = hf[batch]
        hf_speed = decode_tok_s(h, batch, args.new_tokens)
        rows.append(["hf", "-", "-", "-", batch, args.prompt_len, args.new_tokens,
                     h["ttft"] * 1e3, hf_speed, "", "", 1e6 * batch / hf_speed, "", "", "", ""])
        for (tp, graphs, invariant), (results, _) in engine.items():
            e = results[batch]
            speed = decode_tok_s(e, batch, args.new_tokens)
            step_s = batch / speed
            mb = gbs = pct = slower = ""
            if e["bytes"] is not None:
                mb, gbs = e["bytes"] / 1e6, e["bytes"] / step_s / 1e9
                pct = f"{100 * gbs / copy_gbs:.1f}" if copy_gbs else ""
            default = engine.get((tp, graphs, "off"))
            if invariant == "on" and default is not None:
                slower = ratio(speed ** -1, decode_tok_s(default[0][batch], batch,
                                                         args.new_tokens) ** -1)
            rows.append(["engine", tp, graphs, invariant, batch, args.prompt_len,
                         args.new_tokens, e["ttft"] * 1e3, speed,
                         match(e["tokens"], h["tokens"])
                         if getattr(args, "format", "bf16") == "bf16" else "-",
                         ratio(speed, hf_speed),
                         step_s * 1e6, slower, mb, gbs, pct])
    return rows
