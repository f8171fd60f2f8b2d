"""The `kernels` check's matrix of cases and their NVFP4 weights: heavy-tailed random weights
quantized as a checkpoint would hold them, then cut to rank 0's shard (see
`freetoken_verify.checks.kernels.check`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from freetoken.formats.nvfp4.quantizer import quantize
from freetoken.formats.nvfp4.specs import PACKED, SCALE, InputSplit
from freetoken.formats.specs import Split

TP_SIZES = (1, 2, 4, 8)
TOKENS = (1, 7, 64, 300)
KINDS = ("moe", "moe+shared", "linear")
"""The kinds of `KernelCase`."""


@dataclass(frozen=True)
class KernelCase:
    """One kernel launch to check. kind "moe": `experts`, `top_k`; "moe+shared": the same
    plus a shared expert of the routed shapes as one more slot of every token, gated by a
    sigmoid, and the residual (the tensor-core decode's MoE block, GPU only); kind
    "linear": a dense [intermediate / tp, hidden] weight (experts = top_k = 1)."""

    kind: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    tp: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KernelCase: kind {self.kind!r} is none of {', '.join(KINDS)}")

    @property
    def local_intermediate(self) -> int:
        return self.intermediate // self.tp

    @property
    def label(self) -> str:
        shape = f"tokens={self.tokens} hidden={self.hidden} " \
                f"I={self.intermediate}/tp{self.tp}={self.local_intermediate}"
        if self.kind == "linear":
            return f"linear {shape}"
        return f"{self.kind} experts={self.experts} top_k={self.top_k} {shape}"


SHARED_TOKENS = (1, 7, 16)
"""Decode batches of the MoE block with its shared expert as one more slot."""


def gpu_matrix(hiddens=(2048, 1040), intermediate=512) -> list[KernelCase]:
    """The full product on GPU, plus a dense linear per tokens x hidden, plus the MoE block
    with its shared expert (64 experts, top-8) per decode tokens x hidden x TP size, each
    eighth case (`--quick`) among them."""
    cases = [KernelCase("moe", t, e, k, h, intermediate, tp) for t, e, k, h, tp
             in itertools.product(TOKENS, (8, 64), (1, 2, 8), hiddens, TP_SIZES) if k <= e]
    cases += [KernelCase("linear", t, 1, 1, h, intermediate, 1)
              for t, h in itertools.product(TOKENS, hiddens)]
    return cases + [KernelCase("moe+shared", t, 64, 8, h, intermediate, tp) for t, h, tp
                    in itertools.product(SHARED_TOKENS, hiddens, TP_SIZES)]


# (tp, tokens, experts, top_k, hidden index): one decode (<= 16 tokens) and one prefill case per
# TP size; every tokens value of the GPU matrix, and every experts, top-k and hidden value in
# decode and in prefill. Interpreted decode costs about one program pass per (token, slot) pair
# and prefill one per block of an expert hit, so decode keeps pairs few (at most 8) and the
# 64-expert prefill tokens few (20).
CPU_MOE = ((1, 1, 64, 2, 0), (1, 64, 8, 8, 0), (2, 7, 8, 1, 1), (2, 300, 8, 2, 0),
           (4, 1, 8, 8, 1), (4, 20, 64, 1, 1), (8, 7, 8, 1, 0), (8, 300, 8, 1, 1))


def cpu_matrix(hiddens=(64, 48), intermediate=128) -> list[KernelCase]:
    """CPU_MOE (8 MoE cases), then a dense linear per tokens value, hidden alternating."""
    cases = [KernelCase("moe", t, e, k, hiddens[h], intermediate, tp)
             for tp, t, e, k, h in CPU_MOE]
    return cases + [KernelCase("linear", t, 1, 1, hiddens[i % 2], intermediate, 1)
                    for i, t in enumerate(TOKENS)]


def _heavy_tailed(shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    # Student-t (4 dof) by ratio of normals and chi-square: outliers set realistic amaxes.
    device = gen.device
    z = torch.randn(shape, generator=gen, device=device)
    chi2 = torch.randn((4, *shape), generator=gen, device=device).pow(2).sum(0)
    return z / torch.sqrt(chi2 / 4) * scale


def _quantized_shard(w: torch.Tensor, tp: int, rows: bool) -> tuple:
    """Quantize a full checkpoint weight, then take rank 0's shard as the loader would."""

    q = quantize(w)
    packed_spec, scale_spec = (Split(0), Split(0)) if rows else \
        (InputSplit(PACKED, 1), InputSplit(SCALE, 1))
    return (packed_spec.shard(q.packed, 0, tp, "packed"),
            scale_spec.shard(q.block_scale, 0, tp, "block_scale"), q.global_scale)


def make_experts(experts: int, hidden: int, intermediate: int, tp: int, seed: int,
                 device="cpu") -> dict:
    """Rank 0's NVFP4 expert tensors for `tp` ranks, named as `fused_moe` takes them,
    generated and quantized on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = {k: [] for k in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")}
    for _ in range(experts):
        spread = float(torch.empty((), device=device).log_normal_(0.0, 0.5, generator=gen))
        gate = _heavy_tailed((intermediate, hidden), spread / math.sqrt(hidden), gen)
        up = _heavy_tailed((intermediate, hidden), spread / math.sqrt(hidden), gen)
        ratio = 1.8 + 1.2 * float(torch.rand((), generator=gen, device=device))
        up *= ratio * gate.abs().max() / up.abs().max()
        down = _heavy_tailed((hidden, intermediate), 1.0 / math.sqrt(intermediate), gen)
        (gp, gs, gg), (upk, us, ug) = (_quantized_shard(m, tp, True) for m in (gate, up))
        dp, ds, dg = _quantized_shard(down, tp, False)
        for key, value in zip(parts, (torch.cat([gp, upk]), torch.cat([gs, us]),
                                      torch.stack([gg, ug]), dp, ds, dg)):
            parts[key].append(value)
    return {k: torch.stack(v) for k, v in parts.items()}


def weights_for(case: KernelCase, device, cache: dict) -> dict:
    """The case's weights, shared by every case of the same shape (quantizing 64 experts at
    H = 2048 costs more than the kernels)."""
    key = (case.kind, case.experts, case.hidden, case.intermediate, case.tp)
    if key not in cache:
        seed = sum(key[1:]) * 7919 + len(case.kind)
        if case.kind == "linear":
            gen = torch.Generator(device=device).manual_seed(seed)
            shape = (case.local_intermediate, case.hidden)
            q = quantize(_heavy_tailed(shape, 1.0 / math.sqrt(case.hidden), gen))
            cache[key] = {"packed": q.packed, "block_scale": q.block_scale,
                          "global_scale": q.global_scale}
        else:   # "moe+shared": the last expert is the shared one
            cache[key] = make_experts(case.experts + (case.kind == "moe+shared"), case.hidden,
                                      case.intermediate, case.tp, seed, device)
    return cache[key]
