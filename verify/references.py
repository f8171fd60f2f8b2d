"""Reference outputs the golden check compares with: the stored golden of a bundled case, or
HF transformers run live on the same checkpoint (same dtype, same device as rank 0)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from verify.cases import NUM_GREEDY, PROMPT_LENS, hf_reference, load_reference, make_prompts


@dataclass
class Reference:
    source: str
    prompts: list[list[int]]
    prefill_logits: list[torch.Tensor]
    greedy_ids: list[list[int]]
    greedy_logits: list[torch.Tensor]

    @classmethod
    def from_tensors(cls, source: str, prompts, tensors: dict) -> Reference:
        n = range(len(prompts))
        return cls(source, [list(map(int, p)) for p in prompts],
                   [tensors[f"prefill_logits_{i}"] for i in n],
                   [tensors[f"greedy_ids_{i}"].tolist() for i in n],
                   [tensors[f"greedy_logits_{i}"] for i in n])


def reference_source(case, options) -> str:
    """`golden` for bundled cases at full depth, `hf` otherwise (or as asked)."""
    if options.reference != "auto":
        return options.reference
    return "golden" if case.bundled and options.num_layers is None else "hf"


def prompts_for(case, options) -> tuple[list[list[int]], int]:
    """(prompts, greedy length) the reference covers, known before any model runs."""
    if reference_source(case, options) == "golden":
        meta = json.loads((case.folder / "meta.json").read_text())
        return meta["prompts"], meta["num_greedy"]
    return make_prompts(0, PROMPT_LENS, case.model_config.vocab_size), NUM_GREEDY


def reference_for(ctx) -> Reference:
    """The reference for ctx.case, computed once per run (cached across TP sizes)."""
    key = ("reference", ctx.case.name)
    if key not in ctx.cache:
        if reference_source(ctx.case, ctx.options) == "golden":
            meta, tensors = load_reference(ctx.case.folder)
            ctx.cache[key] = Reference.from_tensors("golden", meta["prompts"], tensors)
        else:
            ctx.cache[key] = live_hf_reference(ctx.case, ctx.options,
                                               ctx.runner.placement.device_for(0))
    return ctx.cache[key]


@torch.inference_mode()
def live_hf_reference(case, options, device) -> Reference:
    from transformers import AutoModelForCausalLM

    from freetoken.engine.core import resolve_dtype

    extra = {} if options.num_layers is None else {"num_hidden_layers": options.num_layers}
    dtype = resolve_dtype(options.dtype, case.model_config)
    model = AutoModelForCausalLM.from_pretrained(case.folder, dtype=dtype, **extra)
    model = model.to(device).eval()
    prompts, num_greedy = prompts_for(case, options)
    tensors = hf_reference(model, prompts, num_greedy)
    del model
    return Reference.from_tensors("hf", prompts, tensors)
