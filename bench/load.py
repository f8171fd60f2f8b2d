"""Checkpoint load time and peak host memory per rank, with fresh shards and with views.

    .venv/bin/python bench/load.py [--tp 1,2,4] [--layers 10] [--dtype float32|bfloat16]
        [--modes clone,view,view-held] [--model FOLDER]

Without `--model` a Llama-architecture checkpoint (hidden 2048, intermediate 5632, 16 heads,
4 KV heads, vocab 32000, untied head, `--layers` decoder layers; 2.3 GB at 10 layers in fp32)
is written with safetensors directly from random tensors into a temporary folder, as several
files with a `model.safetensors.index.json`, read once to warm the page cache, and deleted at
the end.

Method. For each TP size and mode a fresh rank group (`RankGroup`, `cpu-gloo`) is started and
every rank builds `EngineCore(folder, EngineConfig(tp=N, device="cpu", progress=False,
num_kv_blocks=1))` at the same time, as the engine does. Per rank:

* `load_s`: wall time of the `EngineCore(...)` construction (model build + load + a one-block
  KV cache, so the cache adds nothing measurable);
* `peak_rss` / `peak_anon`: growth over the rank's own RSS just before the load, sampled by a
  thread every 20 ms with `psutil` (`anon` = RSS minus file-backed and shared pages:
  memory only this rank holds; the rest of RSS is mapped checkpoint pages, which live in the
  page cache and are shared by every rank reading the same file);
* `after_rss`: RSS growth once the constructor has returned (what the load left behind);
* `local`: the bytes of the rank's parameters; `rss/local` and `anon/local` are the peaks
  over it.

Modes (the view modes monkeypatch `freetoken.loading.specs` inside each rank process):

* `clone`: the engine as is; every shard is a fresh copy.
* `view`: `_chunk` returns `full.narrow(...)` and `Replicate.shard` returns `full`, so every
  shard aliases the full checkpoint tensor. The loader still copies each shard into the
  parameter and drops it.
* `view-held`: as `view`, and every shard is also kept alive until the load ends, as in a
  loader that adopts shards as parameter storage (`param.data = shard`) or collects a rank
  state dict before assigning it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from _common import cpu_name, int_list
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.distributed import Placement, RankGroup  # noqa: E402

DIMS = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
            num_key_value_heads=4, head_dim=128, vocab_size=32000)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("clone", "view", "view-held")
LAYERS_PER_FILE = 2
SAMPLE_S = 0.02
MIB = 2**20
SEED = 0

_HELD: list[torch.Tensor] = []


def mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int_list, default=[1, 2, 4], help="TP sizes (default 1,2,4)")
    p.add_argument("--layers", type=int, default=10, help="decoder layers (default 10)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--modes", type=mode_list, default=list(MODES),
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--model", type=Path, default=None,
                   help="an existing Llama checkpoint folder instead of a generated one")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be >= 1")
    return args


# --- the checkpoint ------------------------------------------------------------------------


def layer_shapes(layer: int) -> dict[str, tuple[int, ...]]:
    h, i, hd = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["head_dim"]
    q, kv = DIMS["num_attention_heads"] * hd, DIMS["num_key_value_heads"] * hd
    p = f"model.layers.{layer}"
    return {
        f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
        f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
        f"{p}.mlp.down_proj.weight": (h, i),
    }


def file_shapes(layers: int) -> list[dict[str, tuple[int, ...]]]:
    """Tensor shapes per file: LAYERS_PER_FILE decoder layers each, embeddings last."""
    files = []
    for first in range(0, layers, LAYERS_PER_FILE):
        shapes = {}
        for layer in range(first, min(first + LAYERS_PER_FILE, layers)):
            shapes.update(layer_shapes(layer))
        files.append(shapes)
    v, h = DIMS["vocab_size"], DIMS["hidden_size"]
    files.append({"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                  "model.norm.weight": (h,)})
    return files


def make_checkpoint(folder: Path, layers: int, dtype: torch.dtype) -> int:
    """Write the checkpoint one file at a time; returns its tensor bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(SEED)
    files = file_shapes(layers)
    weight_map, total = {}, 0
    for n, shapes in enumerate(files, 1):
        name = f"model-{n:05d}-of-{len(files):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(dtype) for k, s in shapes.items()}
        total += sum(t.nbytes for t in tensors.values())
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = dict(DIMS, architectures=["LlamaForCausalLM"], model_type="llama",
                  num_hidden_layers=layers, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=2048, tie_word_embeddings=False,
                  dtype=str(dtype).removeprefix("torch."), eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return total


def warm_page_cache(folder: Path) -> int:
    """Read every weight file once so no mode pays the first read from disk."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            while chunk := f.read(64 * MIB):
                total += len(chunk)
    return total


# --- rank functions (module level: pickled to the rank processes) ----------------------------


def _use_views(ctx, hold: bool) -> None:
    """Make every shard alias its full checkpoint tensor; with `hold`, keep each alive."""
    from freetoken.loading import specs

    def chunk(full, dim, rank, size, name):
        length = full.shape[dim]
        if length % size:
            raise specs.ShardError(f"{name}: dim {dim} of size {length} cannot be split "
                                   f"across tp_size={size}")
        view = full.narrow(dim, rank * (length // size), length // size)
        if hold:
            _HELD.append(view)
        return view

    def replicate(self, full, rank, size, name=""):
        if hold:
            _HELD.append(full)
        return full

    specs._chunk = chunk
    specs.Replicate.shard = replicate
    probe = torch.zeros(4, 2)
    assert specs.Split(0).shard(probe, 1, 2).untyped_storage().data_ptr() == \
        probe.untyped_storage().data_ptr(), "views not in effect"
    _HELD.clear()


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

    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info()
    peak = {"rss": before.rss, "anon": before.rss - before.shared}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_memory, args=(proc, stop, peak), daemon=True)
    sampler.start()
    cfg = EngineConfig(folder, tp=ctx.size, device="cpu", dtype=dtype, progress=False,
                       num_kv_blocks=1)
    t0 = time.perf_counter()
    core = EngineCore(folder, cfg, "cpu")
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    after = proc.memory_info()
    peak_rss, peak_anon = max(peak["rss"], after.rss), max(peak["anon"], after.rss - after.shared)
    local = sum(p.nbytes for p in core.model.parameters())
    _HELD.clear()
    return {"load_s": seconds, "peak_rss": peak_rss - before.rss,
            "peak_anon": peak_anon - (before.rss - before.shared),
            "after_rss": after.rss - before.rss, "local": local}


# --- driver --------------------------------------------------------------------------------


def run_one(folder: Path, tp: int, mode: str, dtype: str) -> list[dict]:
    with RankGroup(tp, Placement("cpu-gloo"), timeout=600.0) as group:
        if mode != "clone":
            group.run(_use_views, mode == "view-held")
        return group.run(_measure_load, str(folder), dtype)


def machine() -> str:
    import safetensors

    ram = psutil.virtual_memory().total / 2**30
    return (f"machine: {platform.machine()} {cpu_name()}, os.cpu_count()={os.cpu_count()}, "
            f"{ram:.0f} GiB RAM, torch {torch.__version__}, safetensors {safetensors.__version__}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="freetoken-bench-load-") as tmp:
        folder = args.model or Path(tmp) / "llama"
        began = time.perf_counter()
        if args.model is None:
            size = make_checkpoint(folder, args.layers, DTYPES[args.dtype])
            print(f"wrote {size / 1e9:.2f} GB ({size / 2**30:.2f} GiB) in "
                  f"{time.perf_counter() - began:.0f}s: {folder}", file=sys.stderr)
        size = warm_page_cache(folder)
        for tp in args.tp:
            for mode in args.modes:
                results = run_one(folder, tp, mode, args.dtype)
                for rank, r in enumerate(results):
                    rows.append([tp, mode, rank, r["load_s"], r["peak_rss"] / MIB,
                                 r["peak_anon"] / MIB, r["after_rss"] / MIB, r["local"] / MIB,
                                 r["peak_rss"] / r["local"], r["peak_anon"] / r["local"]])
                print(f"tp={tp} {mode}: done ({time.perf_counter() - began:.0f}s)",
                      file=sys.stderr)
    print(machine())
    label = str(args.model) if args.model else (
        f"generated Llama, {args.layers} layers, " + ", ".join(f"{k}={v}" for k, v in DIMS.items()))
    print(f"checkpoint: {label}; {size / 2**30:.2f} GiB of {args.dtype} safetensors files "
          "(page cache warm)")
    print("MiB of growth over each rank's RSS just before the load; anon = RSS minus "
          "file-backed and shared pages")
    print()
    print(tabulate(rows, headers=["tp", "mode", "rank", "load_s", "peak_rss_MiB",
                                  "peak_anon_MiB", "after_rss_MiB", "local_param_MiB",
                                  "rss/local", "anon/local"],
                   floatfmt=("", "", "", ".2f", ".0f", ".0f", ".0f", ".0f", ".2f", ".2f")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
