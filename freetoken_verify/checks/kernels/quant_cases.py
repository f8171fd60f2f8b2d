"""The `kernels` check's quantized-GEMM cases (`freetoken_verify.checks.kernels.quant` runs
them): every weight-only GEMM the engine has (NVFP4 dense in ModelOpt's and
compressed-tensors' scale conventions, FP8 per tensor, FP8 block, and the routed experts in
block FP8 and NVFP4), each at the TP-local shape of one rank of TP 1, 2, 4 and 8.

Two sources of layouts (`freetoken_verify.checks.quant_layout`):

- a fixed matrix every run checks, whatever the model: Qwen3.5's fused attention
  `q | gate | k | v` (per-row q and gate scales, KV heads replicated at TP 4 and 8), its
  GatedDeltaNet `in_proj` `q | k | v | z` (k and v starting inside in_proj_qkv, inside a
  block), a row-parallel projection and routed experts, at small dimensions and 24 x 40
  blocks chosen so that every dim ends in a partial block and at TP 8 ranks share blocks;
  on a GPU also Qwen3.5-35B-A3B's real dimensions with 128 x 128 blocks;
- the model under verification: each quantized destination of its config (one case per
  destination kind and format), at every TP size the model can run (a real model's experts
  and LM head bounded: `_bounded`).

Each case takes the LAST rank of its TP size: it holds the partial last block, and where a
rank's slice is smaller than a block it starts inside one (rank 0 always starts at 0)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from freetoken.formats.quant.format import (
    COMPRESSED_TENSORS,
    FP8_BLOCK,
    FP8_TENSOR,
    HF_FP8,
    MODELOPT,
    NVFP4,
    ModuleFormat,
)
from freetoken.layers.quantization import Split
from freetoken.models.registry import check_tp
from freetoken_verify.checks.quant_layout import Experts, Layout, destination_layout, rows_on

TP_SIZES = (1, 2, 4, 8)
TOKENS = {"cpu": (1, 7, 33), "cuda": (1, 64)}
FIXED = "fixed"
SMALL_BLOCK, REAL_BLOCK = (24, 40), (128, 128)


@dataclass(frozen=True)
class QuantCase:
    """One GEMM to check: `layout` (a fused linear or routed experts) in `fmt`, on rank
    `rank` of `tp`, for `tokens` tokens; `model` names where the layout came from."""

    fmt: ModuleFormat
    layout: Layout | Experts
    tp: int
    rank: int
    tokens: int
    model: str = FIXED

    @property
    def label(self) -> str:
        """`FP8 block 24x40 (fp8) qkv_proj (q | gate | k | v) tp=8 rank 7 (out 16+16+16+16,
        in 112, tokens 7)`."""
        where = f"tp={self.tp} rank {self.rank}"
        if isinstance(self.layout, Experts):
            e = self.layout
            local = e.intermediate // self.tp
            dims = (f"experts {e.experts}, top_k {e.top_k}, hidden {e.hidden}, "
                    f"I {e.intermediate}/{self.tp}={local}")
            return f"{self.fmt.describe()} routed experts {where} ({dims}, tokens {self.tokens})"
        rows = "+".join(str(rows_on(s, self.rank, self.tp)[1]) for s in self.layout.rows)
        cols = rows_on(self.layout.cols, self.rank, self.tp)[1]
        return (f"{self.fmt.describe()} {self.layout.label} {where} (out {rows}, in {cols}, "
                f"tokens {self.tokens})")


def _formats(block: tuple[int, int]) -> tuple[ModuleFormat, ...]:
    return (ModuleFormat(NVFP4, MODELOPT), ModuleFormat(NVFP4, COMPRESSED_TENSORS),
            ModuleFormat(FP8_TENSOR, MODELOPT), ModuleFormat(FP8_BLOCK, HF_FP8, block))


def _layouts(hidden: int, heads: int, head_dim: int, kv_heads: int, key: int, value: int,
             row_in: int) -> tuple[Layout, ...]:
    """Qwen3.5's fused attention and GatedDeltaNet in_proj, and a row-parallel layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    gated = Split(q, per_row=True, group=0)
    total = 2 * key + value
    whole = Split.whole(hidden)
    return (Layout("qkv_proj (q | gate | k | v)",
                   (gated, gated, Split(kv, heads=kv_heads, group=1),
                    Split(kv, heads=kv_heads, group=2)), whole),
            Layout("in_proj (q | k | v | z)",
                   (Split(key, start=0, total=total, group=0),
                    Split(key, start=key, total=total, group=0),
                    Split(value, start=2 * key, total=total, group=0), Split(value, group=1)),
                   whole),
            Layout("row-parallel", (whole,), Split(row_in)))


# Small: hidden 112 = 4 x 24 + 16 rows = 2 x 40 + 32 inputs; GatedDeltaNet key 40 (k starts
# at 40 = 24 + 16, v at 80 = 3 x 24 + 8, in_proj_qkv 160 = 6 x 24 + 16 rows), value 80; q
# and gate 8 heads x 16 (16 rows a rank at TP 8), 2 KV heads of 16 rows; the row-parallel
# layer's 384 = 9 x 40 + 24 inputs split into 48 at TP 8 (three NVFP4 groups, sharing
# 40-blocks); experts I = 128 = 5 x 24 + 8 = 3 x 40 + 8, 16 a rank at TP 8.
SMALL = dict(hidden=112, heads=8, head_dim=16, kv_heads=2, key=40, value=80, row_in=384)
SMALL_EXPERTS = Experts(experts=8, top_k=2, hidden=112, intermediate=128)
# Qwen3.5-35B-A3B: hidden 2048, 16 heads x 256, 2 KV heads, GatedDeltaNet 16 x 128 key and
# 32 x 128 value dims, o_proj / out_proj 4096 inputs; experts I = 512 (64 a rank at TP 8,
# half a block), 16 of the 256 experts with top-8.
REAL = dict(hidden=2048, heads=16, head_dim=256, kv_heads=2, key=2048, value=4096,
            row_in=4096)
REAL_EXPERTS = Experts(experts=16, top_k=8, hidden=2048, intermediate=512)


def _cases(formats, layouts, experts: Experts, model: str) -> list[QuantCase]:
    out = []
    for tp in TP_SIZES:
        for fmt in formats:
            out += [QuantCase(fmt, layout, tp, tp - 1, 0, model) for layout in layouts]
        out += [QuantCase(fmt, experts, tp, tp - 1, 0, model) for fmt in formats
                if fmt.kind == FP8_BLOCK or fmt.producer == COMPRESSED_TENSORS]
    return out


def with_tokens(cases: list[QuantCase], device_type: str) -> list[QuantCase]:
    """The cases with their token counts: on GPU each case once per count (decode and
    prefill GEMMs); on CPU the counts take turns."""
    tokens = TOKENS[device_type]
    if device_type == "cuda":
        return [replace(c, tokens=t) for c in cases for t in tokens]
    return [replace(c, tokens=tokens[i % len(tokens)]) for i, c in enumerate(cases)]


def fixed_matrix(device_type: str) -> list[QuantCase]:
    """Every format x layout at TP 1/2/4/8 at the small dimensions (56 cases; the experts in
    block FP8 and compressed-tensors NVFP4, ModelOpt's being the NVFP4 part's), plus on a
    GPU the same at Qwen3.5-35B-A3B's dimensions with 128 x 128 blocks."""
    cases = _cases(_formats(SMALL_BLOCK), _layouts(**SMALL), SMALL_EXPERTS, FIXED)
    if device_type == "cuda":
        cases += _cases(_formats(REAL_BLOCK), _layouts(**REAL), REAL_EXPERTS,
                        "qwen3.5-moe-realdims")
    return with_tokens(cases, device_type)


def model_matrix(cfg, name: str) -> list[QuantCase]:
    """One case per quantized destination kind (and format) of model config `cfg` at every
    TP size it can run, tokens to be set (`with_tokens`); none for an unquantized model. A
    quantized destination the harness has no layout for raises
    (`freetoken_verify.checks.quant_layout.LayoutError`)."""
    sizes = []
    for tp in TP_SIZES:
        try:
            check_tp(cfg, tp)
        except ValueError:
            continue
        sizes.append(tp)
    seen, cases = set(), []
    for dest, gemms in cfg.module_formats.items():
        for gemm in gemms:
            if not gemm.format.quantized:
                continue
            for tp in sizes:
                layout = _bounded(destination_layout(cfg, dest, tp), cfg, tp)
                key = (type(layout).__name__, getattr(layout, "label", ""), gemm.format, tp)
                if key not in seen:
                    seen.add(key)
                    cases.append(QuantCase(gemm.format, layout, tp, tp - 1, 0, name))
    return sorted(cases, key=lambda c: c.tp)


MAX_EXPERTS, MAX_VOCAB = 16, 8192


def _bounded(layout: Layout | Experts, cfg, tp: int) -> Layout | Experts:
    """A real model's layout with what does not change a rank's GEMM bounded: at most 16
    experts (top-k at most that; routing, not shapes, depends on the count), and an LM head
    of more than 8192 rows cut to 8192 + vocab mod 8 (the same padding at every TP size up
    to 8), so a 248k vocabulary does not cost gigabytes of test weights."""
    if isinstance(layout, Experts):
        experts = min(layout.experts, MAX_EXPERTS)
        return replace(layout, experts=experts, top_k=min(layout.top_k, experts))
    if layout.label == "lm_head" and cfg.vocab_size > MAX_VOCAB:
        rows = MAX_VOCAB + cfg.vocab_size % 8
        return replace(layout, rows=(Split(-(-rows // tp) * tp),))
    return layout
