"""The reference a check compares the engine with, whatever its source (stored golden, live
HF, a saved reference): its own module so that the sources can all build it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BisectActivations:
    """HF's per-module activations on the bisect prompt followed by HF's first greedy token:
    `by_dtype` maps "float32" (and the engine's low precision, where it was saved for one) to
    HF module name -> `[rows, features]` float32 on the CPU (`freetoken_verify.activations.hf`)."""

    prompt: list[int]
    token: int
    by_dtype: dict[str, dict[str, torch.Tensor]]


@dataclass
class Reference:
    """What the engine is compared with. `baseline[i]` (engine in bf16 / fp16 only) measures
    how far HF itself at that dtype is from HF in fp32 on prompt i: the reference's own noise,
    which widens the low-precision tolerances for a model that is numerically sensitive. A
    live reference measures it by running HF at that dtype; a golden one stores it (measured
    on CPU when `make golden` wrote the case). `twin`: for a quantized checkpoint, the
    dequantized twin HF ran on (`freetoken_verify.reference.twin.Twin.entry`)."""

    source: str
    prompts: list[list[int]]
    prefill_logits: list[torch.Tensor]
    greedy_ids: list[list[int]]
    greedy_logits: list[torch.Tensor]
    baseline: list | None = None
    bisect: BisectActivations | None = None
    twin: dict | None = None

    @classmethod
    def from_tensors(cls, source: str, prompts, tensors: dict) -> Reference:
        n = range(len(prompts))
        return cls(source, [list(map(int, p)) for p in prompts],
                   [tensors[f"prefill_logits_{i}"] for i in n],
                   [tensors[f"greedy_ids_{i}"].tolist() for i in n],
                   [tensors[f"greedy_logits_{i}"] for i in n])
