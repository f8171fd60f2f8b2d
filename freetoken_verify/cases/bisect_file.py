"""HF's per-module activations on the bisect prompt, kept beside a reference so that the
bisect check compares with HF without running it: a bundled case (written by `make golden`)
and a saved reference (`--save-reference`) keep them the same way, `bisect.safetensors`
(keys `dtype/module`, float32 `[rows, features]` as `freetoken_verify.activations.hf` gives
them) and an entry in the folder's metadata: the prompt, HF's first greedy token after it
(the decode step's input) and the dtypes held."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken_verify.activations.hf import hf_activations

BISECT = "bisect.safetensors"
MAX_BISECT_PROMPT = 32
"""The longest prompt bisect captures: one prefill step takes it whole."""


def bisect_prompt_of(prompts: list[list[int]]) -> list[int]:
    """The prompt bisect captures: the longest reference prompt of at most
    MAX_BISECT_PROMPT tokens (else the first one, cut to that length)."""
    fitting = [p for p in prompts if len(p) <= MAX_BISECT_PROMPT]
    return list(max(fitting, key=len) if fitting else prompts[0][:MAX_BISECT_PROMPT])


def record(model, prompts: list[list[int]], prefill_logits: list[torch.Tensor]
           ) -> tuple[list[int], int, dict[str, torch.Tensor]]:
    """(bisect prompt, HF's greedy token after it, `model`'s activations on both): the token
    is read off the reference's prefill logits (the bisect prompt is a prefix of one of
    `prompts`)."""
    prompt = bisect_prompt_of(prompts)
    i = next(i for i, p in enumerate(prompts) if p[: len(prompt)] == prompt)
    token = int(prefill_logits[i][len(prompt) - 1].argmax())
    return prompt, token, hf_activations(model, prompt + [token])


def save(folder: Path, prompt: list[int], token: int,
         by_dtype: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Write `by_dtype` (dtype name -> HF module -> activation) into `folder`'s
    bisect.safetensors; returns the metadata entry that `load` takes back."""
    save_file({f"{d}/{name}": t.contiguous() for d, by_name in by_dtype.items()
               for name, t in by_name.items()}, Path(folder) / BISECT)
    return {"prompt": list(prompt), "token": int(token), "dtypes": sorted(by_dtype)}


def load(folder: str | Path, info) -> tuple[list[int], int, dict] | None:
    """(prompt, token, dtype name -> HF module -> activation) that `save` wrote with metadata
    entry `info`; None where there is no entry or no file."""
    path = Path(folder) / BISECT
    if not isinstance(info, dict) or not path.is_file():
        return None
    by_dtype: dict[str, dict[str, torch.Tensor]] = {d: {} for d in info["dtypes"]}
    for key, t in load_file(path).items():
        dtype, _, name = key.partition("/")
        by_dtype.setdefault(dtype, {})[name] = t
    return list(info["prompt"]), int(info["token"]), by_dtype
