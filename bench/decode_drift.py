"""How far each bf16 decode path lies from a float32 engine on the same checkpoint,
position by position: a float32 engine (eager) decodes greedily; every arm then runs the same
positions teacher-forced (the prompt extended by the float32 tokens, one prefill and one
decode step per position) and its logits are compared with the float32 engine's. A fused path
that drifts further from float32 than the torch path does is suspect; one as far as the torch
path only rounds differently.

    python3 bench/decode_drift.py --model FOLDER [--positions 10] [--device cuda]

Arms (bf16, `enforce_eager`): `torch` (the engine's torch path, `core.use_kernels=False`),
`rows` (the default CUDA path), `no-shared-rows` and `no-moe-rows` (`fused_moe`'s switches,
as in `bench/tile_ab.py`). Per position: relative L2 of the prefill logits (`p`) and of the
decode step's (`d`, where the arm's prefill picked the float32 token), `!` where the arm's
argmax differs, and the float32 top-2 margin (`m`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken import LLM, SamplingParams  # noqa: E402
from freetoken.cli import USAGE_ERRORS  # noqa: E402
from freetoken.kernels import fused_moe  # noqa: E402

ARMS = {"torch": dict(kernels=False), "rows": {}, "no-shared-rows": dict(shared=False),
        "no-moe-rows": dict(rows=False, shared=False)}


def forced(llm: LLM, prompt: list[int], tokens: list[int]) -> list[tuple]:
    """(first token, prefill logits, decode logits) after each prefix of `tokens`."""
    out = []
    for k in range(len(tokens)):
        r = llm.generate([prompt + tokens[:k]],
                         SamplingParams(max_tokens=2, ignore_eos=True, return_logits=True))[0]
        out.append((r.token_ids[0], r.logits[0].float().cpu(), r.logits[1].float().cpu()))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--positions", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args()
    if args.positions < 1 or args.prompt_len < 1:
        p.error("--positions and --prompt-len must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")
    try:
        drift(args)
    except USAGE_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def drift(args: argparse.Namespace) -> None:
    """Print the float32 tokens and each arm's drift from them (the module docstring)."""
    options = dict(device=args.device, progress=False, enforce_eager=True)
    with LLM(args.model, dtype="float32", **options) as llm:
        vocab = llm.limits.vocab_size
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, min(1000, vocab), (args.prompt_len,), generator=gen).tolist()
        tokens = llm.generate([prompt], SamplingParams(max_tokens=args.positions,
                                                       ignore_eos=True))[0].token_ids
        reference = forced(llm, prompt, tokens)
    print("float32 greedy", tokens)
    with LLM(args.model, dtype="bfloat16", **options) as llm:
        core = llm._core
        for name, arm in ARMS.items():
            core.use_kernels = arm.get("kernels", args.device == "cuda")
            fused_moe.ROWS_AT_ONE_TOKEN = arm.get("rows", True)
            fused_moe.SHARED_IN_ROWS = arm.get("shared", True)
            cells = []
            for k, ((t0, p0, d0), (t1, p1, d1)) in enumerate(zip(reference,
                                                                 forced(llm, prompt, tokens))):
                top = d0.topk(2).values
                decode = f"{rel(d1, d0):.3f}" if t0 == t1 else "-"
                flip = "" if p1.argmax() == p0.argmax() else "!"
                cells.append(f"{k}:p{rel(p1, p0):.3f}{flip}/d{decode}(m{top[0] - top[1]:.2f})")
            free = llm.generate([prompt], SamplingParams(max_tokens=args.positions,
                                                         ignore_eos=True))[0].token_ids
            same = next((i for i, (a, b) in enumerate(zip(free, tokens)) if a != b), None)
            print(f"{name}: {' '.join(cells)}; free greedy parts from float32 at "
                  f"{'never' if same is None else f'token {same}'}: {free}", flush=True)
        core.use_kernels = args.device == "cuda"
        fused_moe.ROWS_AT_ONE_TOKEN = fused_moe.SHARED_IN_ROWS = True


if __name__ == "__main__":
    sys.exit(main())
