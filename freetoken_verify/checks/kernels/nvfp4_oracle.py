"""An NVFP4 oracle written from the format definition, independent of the engine: the
`kernels` check judges both the Triton kernels and the engine's torch NVFP4 backend by it, so a
bug in the backend is reported as the backend's, not as a kernel failure.

Format (ModelOpt): byte j of a packed row holds element 2j in its low nibble and 2j + 1 in its
high nibble; a nibble is an e2m1 code, bit 3 the sign and codes 0..7 the values 0, .5, 1, 1.5,
2, 3, 4, 6; each 16 consecutive inputs share one e4m3 block scale (1 sign bit, 4 exponent bits
with bias 7, 3 mantissa bits, exponent 0 subnormal, 0x7F / 0xFF NaN); one float32 global scale
per tensor multiplies everything: value = e2m1 * block_scale * global.

Values are computed in float64, where e2m1 * e4m3 * an fp32 global is exact, then rounded to
float32 once: bit for bit the float32 value a correct dequantizer produces."""

from __future__ import annotations

import torch

GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of 4-bit codes (any integer dtype, values 0..15)."""
    table = torch.tensor(E2M1, dtype=torch.float64, device=codes.device)
    codes = codes.long()
    magnitude = table[codes & 0x7]
    return torch.where(codes & 0x8 != 0, -magnitude, magnitude)


def e4m3_values(scale: torch.Tensor) -> torch.Tensor:
    """float64 values of float8_e4m3fn block scales, decoded from their bits."""
    b = scale.contiguous().view(torch.uint8).long()
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0).to(torch.float64)
    exponent, mantissa = (b >> 3) & 0xF, (b & 0x7).to(torch.float64)
    normal = (1.0 + mantissa / 8.0) * torch.pow(2.0, (exponent - 7).to(torch.float64))
    subnormal = mantissa / 8.0 * 2.0 ** -6
    value = sign * torch.where(exponent == 0, subnormal, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.nan, value)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2n] from bytes [..., n]: element 2j from the low nibble of byte j."""
    p = packed.long()
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] of one NVFP4 tensor; `global_scale` a 0-dim or 1-element
    float32 tensor."""
    values = e2m1_values(unpack(packed))
    blocks = e4m3_values(block_scale).repeat_interleave(GROUP, dim=-1)
    g = global_scale.reshape(()).to(torch.float64)
    return (values * blocks * g).to(torch.float32)


def w13(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
        ) -> torch.Tensor:
    """One expert's `[gate; up]` [2I, H]: the first I rows with global_scale[0], the rest
    with global_scale[1] (gate and up carry their own `weight_scale_2`)."""
    inter = packed.shape[0] // 2
    return torch.cat([dequantize(packed[:inter], block_scale[:inter], global_scale[0]),
                      dequantize(packed[inter:], block_scale[inter:], global_scale[1])])


def moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        w13_weights: dict[int, torch.Tensor], w2_weights: dict[int, torch.Tensor]
        ) -> torch.Tensor:
    """Routed-expert output [T, H] in float64: for each token and each of its top-k slots,
    weight * down(silu(gate(x)) * up(x)) with the given dequantized experts."""
    xd = x.to(torch.float64)
    out = torch.zeros_like(xd)
    for e in sorted(set(topk_ids.flatten().tolist())):
        token, slot = torch.where(topk_ids == e)
        gate_up = xd[token] @ w13_weights[e].to(torch.float64).T
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        h = gate * torch.sigmoid(gate) * up
        down = h @ w2_weights[e].to(torch.float64).T
        out.index_add_(0, token, down * topk_weights[token, slot].to(torch.float64)[:, None])
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x W^T` in float64 for a dequantized weight W [N, K]."""
    return x.to(torch.float64) @ weight.to(torch.float64).T
