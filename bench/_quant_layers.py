"""Rank-local quantized linear layers of Qwen3.5-35B-A3B's projections with random contents,
for `quant_linear.py` (its timings and its GPU check): each format's method built as the
model builds it (`method_for`, the model's segments), for any rank of any TP size, its
tensors filled with valid random values (every block scale and every segment's scale or
global its own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken.formats.quant.format import (
    COMPRESSED_TENSORS,
    FP8_BLOCK,
    FP8_TENSOR,
    HF_FP8,
    MODELOPT,
    NVFP4,
    ModuleFormat,
)
from freetoken.layers.quantization.method import Split, method_for

FORMATS = {
    "fp8-block": ModuleFormat(FP8_BLOCK, HF_FP8, (128, 128)),
    "fp8-tensor": ModuleFormat(FP8_TENSOR, MODELOPT),
    "nvfp4": ModuleFormat(NVFP4, MODELOPT),
    "nvfp4-ct": ModuleFormat(NVFP4, COMPRESSED_TENSORS),
}
KEY, VALUE, HEADS_Q = 16 * 128, 32 * 128, 16 * 256


@dataclass(frozen=True)
class Shape:
    """A projection: its output segments (`Split`s, as the model declares them), its full
    input size, and whether the inputs are split across ranks (row-parallel)."""

    segments: tuple[Split, ...]
    in_features: int
    row_parallel: bool = False
    formats: tuple[str, ...] = tuple(FORMATS)


def _gdn_in_proj() -> tuple[Split, ...]:
    total = 2 * KEY + VALUE
    return (Split(KEY, start=0, total=total, group=0), Split(KEY, start=KEY, total=total, group=0),
            Split(VALUE, start=2 * KEY, total=total, group=0), Split(VALUE, group=1))


SHAPES = {
    # q | gate (scales per row in block FP8, as the model expands them), k, v (2 KV heads)
    "attn.qkv": Shape((Split(HEADS_Q, per_row=True, group=0), Split(HEADS_Q, per_row=True,
                                                                    group=0),
                       Split(512, heads=2, group=1), Split(512, heads=2, group=2)), 2048),
    "attn.o": Shape((Split.whole(2048),), 4096, True),
    "gdn.in_proj_qkvz": Shape(_gdn_in_proj(), 2048, formats=("fp8-block", "fp8-tensor")),
    "gdn.out": Shape((Split.whole(2048),), 4096, True, formats=("fp8-block", "fp8-tensor")),
    "shared.gate_up": Shape((Split(512), Split(512)), 2048),
    "shared.down": Shape((Split.whole(2048),), 512, True),
    "lm_head": Shape((Split(248320),), 2048, formats=("nvfp4",)),
}


class QuantLayer(nn.Module):
    """A bare layer holding one method's tensors (what `LinearBase` holds)."""

    def __init__(self, method, local_in: int, local_out: int):
        super().__init__()
        self.quant = method
        method.create_weights(self, local_in, local_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.apply(self, x)


def make_layer(shape: Shape, fmt: str, rank: int, tp: int, gen: torch.Generator,
               device="cuda") -> QuantLayer:
    """Rank `rank` of `tp`'s layer of `shape` in format `fmt`, filled at random."""
    cols = Split(shape.in_features) if shape.row_parallel else Split.whole(shape.in_features)
    rows = [Split.whole(s.full_size) if shape.row_parallel else s for s in shape.segments]
    method = method_for(FORMATS[fmt], rows, cols, rank, tp)
    local_in = cols.local(tp)
    local_out = sum(r.local(tp) for r in rows)
    with torch.device(device):
        layer = QuantLayer(method, local_in, local_out)
    fill(layer, gen)
    return layer


def fill(layer: nn.Module, gen: torch.Generator) -> None:
    """Valid random contents: e4m3 codes over their range, NVFP4 bytes of every code,
    positive scales varying over two decades."""
    for name, p in layer.named_parameters():
        kw = dict(device=p.device, generator=gen)
        if p.dtype == torch.uint8:
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, **kw))
        elif p.dtype == torch.float8_e4m3fn and name == "weight":
            p.copy_((torch.randn(p.shape, **kw) * 64).clamp(-448, 448).to(p.dtype))
        elif p.dtype == torch.float8_e4m3fn:
            p.copy_((torch.rand(p.shape, **kw) * 3 + 0.05).to(p.dtype))
        else:
            p.copy_(torch.pow(10.0, torch.rand(p.shape, **kw) * 2 - 1) * 1e-3)


def weight_bytes(layer: nn.Module) -> int:
    """What one call reads besides x: every parameter and buffer of the layer (the input
    scales excepted, which the weight-only GEMM does not read)."""
    return sum(t.numel() * t.element_size() for n, t in
               [*layer.named_parameters(), *layer.named_buffers()] if n != "input_scale")
