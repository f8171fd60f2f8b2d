"""Reference outputs the golden check compares with: the stored golden of a bundled case, HF
transformers run live on the same checkpoint (same device as rank 0), or a reference saved
earlier with `--save-reference` (`freetoken_verify.reference.store`)."""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from freetoken.engine.core import resolve_dtype
from freetoken_verify.activations.hf import hf_activations
from freetoken_verify.cases import bisect_file
from freetoken_verify.cases.bisect_file import bisect_prompt_of
from freetoken_verify.cases.catalogue import (
    NUM_GREEDY,
    PROMPT_LENS,
    hf_reference,
    load_reference,
    low_precision_spread,
    reference_prompts,
)
from freetoken_verify.compare import LogitMetrics
from freetoken_verify.reference.data import BisectActivations, Reference
from freetoken_verify.reference.prompts import (
    DEFAULT_SEED,
    PromptError,
    read_prompts_file,
    tokenize_prompts,
)
from freetoken_verify.reference.store import (
    read_bisect,
    read_meta,
    stored_bisect,
    stored_reference,
)
from freetoken_verify.reference.twin import hf_folder, is_quantized, twin_for

__all__ = ["Reference", "bisect_prompt_of"]  # re-exported: checks import them from here


LIVE_CHOICES = ("auto", "golden", "hf")


def stored_dir(options) -> str | None:
    """The saved reference this run reads (`--reference DIR`, or the one `--save-reference
    DIR` writes before the ranks start), or None."""
    if options.save_reference:
        return options.save_reference
    return None if options.reference in LIVE_CHOICES else options.reference


def custom_prompts(options) -> bool:
    """The user chose the prompts or the continuation length: a bundled golden covers neither."""
    return bool(options.prompts_file) or options.seed is not None or \
        options.max_new_tokens is not None


def reference_source(case, options) -> str:
    """`stored` for a saved reference; `golden` for bundled cases at full depth with the
    default prompts, `hf` otherwise (or as asked)."""
    if stored_dir(options):
        return "stored"
    if options.reference != "auto":
        return options.reference
    golden = case.bundled and options.num_layers is None and not custom_prompts(options)
    return "golden" if golden else "hf"


def prompts_for(case, options) -> tuple[list[list[int]], int]:
    """(prompts, greedy length) the reference covers, known before any model runs."""
    source = reference_source(case, options)
    if source == "golden":
        meta = json.loads((case.folder / "meta.json").read_text())
        return meta["prompts"], meta["num_greedy"]
    if source == "stored" and not options.save_reference:
        meta = read_meta(stored_dir(options))
        return meta["prompts"], meta["num_greedy"]
    return requested_prompts(case, options)


def requested_prompts(case, options) -> tuple[list[list[int]], int]:
    """The prompts the options ask for (`--prompts-file`, else seeded random ids with every
    vocab-shard boundary id, `--seed`), and the continuation length (`--max-new-tokens`)."""

    stamp = None
    if options.prompts_file:
        try:
            stat = Path(options.prompts_file).stat()
        except OSError as e:
            raise PromptError(f"--prompts-file: cannot read {options.prompts_file} "
                              f"({e.strerror})") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
    prompts, num_new = _requested(case, options, stamp)
    return [list(p) for p in prompts], num_new


@functools.lru_cache(maxsize=16)
def _requested(case, options, stamp) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Tokenizing a prompts file loads the tokenizer: once per model, options and version of
    the file (`stamp`), so an edited file is read again."""

    num_new = options.max_new_tokens or NUM_GREEDY
    if options.prompts_file:
        prompts = tokenize_prompts(read_prompts_file(options.prompts_file), case)
    else:
        seed = DEFAULT_SEED if options.seed is None else options.seed
        prompts = reference_prompts(seed, PROMPT_LENS, case.model_config.vocab_size)
    return tuple(tuple(p) for p in prompts), num_new


def reference_for(ctx) -> Reference:
    """The reference for ctx.case, built once per run (kept in the model's
    `Baselines.reference` across TP sizes and checks)."""
    return ctx.baselines.reference(
        lambda: build_reference(ctx.case, ctx.options, ctx.runner.placement.device_for(0)))


def build_reference(case, options, device) -> Reference:
    """`case`'s reference from the run's source: its stored golden, the saved reference, or
    HF run now on `device`."""
    source = reference_source(case, options)
    if source == "golden":
        return golden_reference(case, options)
    if source == "stored":
        return stored_reference(stored_dir(options), case, options)
    return live_hf_reference(case, options, device)


def golden_reference(case, options) -> Reference:
    """The stored golden of a bundled case, with its stored baseline at the engine's dtype."""

    meta, tensors = load_reference(case.folder)
    ref = Reference.from_tensors("golden", meta["prompts"], tensors)
    dtype = resolve_dtype(options.dtype, case.model_config)
    stored = meta.get("baselines", {}).get(str(dtype).removeprefix("torch."))
    if dtype != torch.float32 and stored:
        # Measured on another device's kernels than the engine's: per prompt it is a noisy
        # sample of the model's sensitivity at this dtype, so every prompt gets the worst.
        worst = {k: max(m[k] for m in stored) for k in stored[0]}
        ref.baseline = [LogitMetrics(**worst) for _ in stored]
    return ref


def kept_bisect(case, options, state) -> BisectActivations | None:
    """HF's bisect activations that the run's reference keeps, read once per folder through
    `state` (`CheckState`): a saved reference's, or a bundled case's stored golden's (in
    float32: at another dtype the bisect check runs HF for its low-precision bound); None
    where it keeps none."""
    source = reference_source(case, options)
    if source == "stored":
        folder = stored_dir(options)
        return state.saved_bisect(folder, lambda: stored_bisect(folder))
    if source != "golden" or resolve_dtype(options.dtype, case.model_config) != torch.float32:
        return None
    folder = case.folder
    return state.saved_bisect(folder, lambda: read_bisect(folder, json.loads(
        (folder / "meta.json").read_text()).get("bisect")))


def hf_model(case, options, dtype, device):
    """HF's model of `case` at `dtype` on `device`, truncated as `options.num_layers` asks;
    for a quantized checkpoint, HF on its dequantized twin (`freetoken_verify.reference.twin`,
    built into the cache on first use)."""
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = hf_folder(case, options.num_layers)
    config = AutoConfig.from_pretrained(folder)
    text = getattr(config, "text_config", None) or config
    if options.num_layers is not None:
        text.num_hidden_layers = options.num_layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[: options.num_layers]
    cached = _cache_works(text)
    if not cached:
        config.use_cache = text.use_cache = False
    with _hf_bars_off():
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype,
                                                     **_attention(dtype, device))
    if not cached:
        model.generation_config.use_cache = False
    return model.to(device).eval()


def _attention(dtype, device) -> dict:
    """HF's attention implementation where its default cannot run: torch's fused CPU attention
    in bf16 / fp16 packs its operands for AMX, which it refuses under the scalar kernels
    (`ATEN_CPU_CAPABILITY=default` on a CPU with AMX: "pack_vnni2 is only supported when
    avx512 is supported"); HF's eager attention computes the same softmax attention unfused.
    Elsewhere HF's default."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16) and \
            torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return {"attn_implementation": "eager"}
    return {}


@contextmanager
def _hf_bars_off():
    """HF's own `Loading weights` bar off while it loads: the harness reports its progress
    itself, one line per step (and not at all through `freetoken_verify.run(progress=False)`)."""
    # transformers costs seconds to import; only HF references need it.
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _cache_works(text_config) -> bool:
    """HF's hybrid cache measures the sequence on an attention layer: a model truncated to
    linear-attention layers only must run without a cache (every greedy step recomputes the
    prefix, which gives the same logits)."""
    types = getattr(text_config, "layer_types", None)
    return not types or "full_attention" in types


@torch.inference_mode()
def live_hf_reference(case, options, device, with_bisect: bool = False) -> Reference:
    """HF on the checkpoint, on the engine's device. In fp32 that is the reference. For an
    engine in bf16 / fp16 the reference is still HF in fp32 (the exact answer both low-precision
    runs approximate), and HF at the engine's dtype supplies the baseline: how far a correct
    implementation at that precision lands from it (the worst of a few equally valid roundings,
    `low_precision_spread`). `with_bisect` also keeps HF's per-module activations on the
    bisect prompt (what `--save-reference` stores, so that bisect needs no HF later). For a
    quantized checkpoint every HF run is on its dequantized twin, recorded as `ref.twin`."""

    dtype = resolve_dtype(options.dtype, case.model_config)
    prompts, num_greedy = prompts_for(case, options)
    model = hf_model(case, options, torch.float32, device)
    ref = Reference.from_tensors("hf", prompts, hf_reference(model, prompts, num_greedy))
    if is_quantized(case):
        ref.twin = twin_for(case, options.num_layers).entry()
    if with_bisect:
        ref.bisect = _bisect_activations(model, ref)
    del model
    if dtype != torch.float32:
        model = hf_model(case, options, dtype, device)
        ref.baseline = [low_precision_spread(model, p, e)
                        for p, e in zip(prompts, ref.prefill_logits)]
        if with_bisect:
            ids = ref.bisect.prompt + [ref.bisect.token]
            ref.bisect.by_dtype[str(dtype).removeprefix("torch.")] = hf_activations(model, ids)
        del model
        if any(b is None for b in ref.baseline):
            ref.baseline = None
    return ref


def _bisect_activations(model, ref: Reference) -> BisectActivations:
    """HF's activations in float32 on the bisect prompt and HF's greedy token after it."""
    prompt, token, acts = bisect_file.record(model, ref.prompts, ref.prefill_logits)
    return BisectActivations(prompt, token, {"float32": acts})
