"""What the quantized-format model tests share: the engine's outputs on a checkpoint folder
and the comparison with the same prompts on its dequantized twin."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from freetoken import LLM, SamplingParams
from freetoken.formats.shard import write_pieces
from freetoken.models.registry import load_config, shard_plan

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


def generate(folder: Path, tp: int) -> list:
    """Three greedy tokens per prompt of `PROMPTS`, with prompt and step logits, in float32."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, return_logits=True,
                            return_prompt_logits=True)
    with LLM(folder, tp=tp, device="cpu", dtype="float32", progress=False) as llm:
        return llm.generate(PROMPTS, params)


def assert_same_outputs(got: list, want: list, label: str, atol: float = 2e-5) -> None:
    """Equal tokens; prompt and step logits within rtol 1e-5 and `atol` (fp32 reduction
    order: under torch's scalar kernels, ATEN_CPU_CAPABILITY=default, the NVFP4 case's
    prompt logits differed from its twin's by 1.4e-5)."""
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_ids == b.token_ids, f"{label} prompt {i}: {a.token_ids} != {b.token_ids}"
        for what in ("prompt_logits", "logits"):
            torch.testing.assert_close(getattr(a, what), getattr(b, what), rtol=1e-5,
                                       atol=atol,
                                       msg=lambda m, w=what, i=i: f"{label} {i} {w}: {m}")


def assert_round_trips(folder: Path, tp_sizes=(1, 2, 4, 8)) -> None:
    """At each TP size every tensor of `folder`'s checkpoint shards and unshards bitwise
    through its plan rule (compared as bytes: CPU torch cannot compare float8), and the
    loader's pieces write the same bytes as shard()."""
    cfg, tensors = load_config(folder), load_file(folder / "model.safetensors")
    for tp in tp_sizes:
        plan = shard_plan(cfg, tp)
        for name, full in tensors.items():
            spec = plan.resolve(name).rule.spec
            parts = [spec.shard(full, r, tp, name) for r in range(tp)]
            for r, part in enumerate(parts):
                out = torch.empty_like(part)
                write_pieces(spec.pieces(full, r, tp, name), out)
                assert out.view(torch.uint8).equal(part.view(torch.uint8)), f"{name} r{r}"
            back = spec.unshard(parts, name)
            assert back.view(torch.uint8).equal(full.view(torch.uint8)), f"{name} tp={tp}"
