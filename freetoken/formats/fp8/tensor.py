"""FP8 per tensor (ModelOpt `FP8`, compressed-tensors `tensor`): `weight` e4m3 [out, in] and
a 0-d `weight_scale` (a multiplier: value = float(weight) * weight_scale), plus a static
0-d `input_scale` for W8A8 engines. Every module carries its own scales, fused ones too
(ModelOpt does not unify q/k/v or in_proj_qkv / in_proj_z for FP8): a fused destination keeps
one scale per checkpoint tensor, never one for all (vLLM #38517 wrote only the first).

`ScalarScale` is the shard spec of both scales: replicated, float32, checked finite and
above 0 (a zero or NaN scale silently zeroes or poisons the module). It is also the check of
the stored per-tensor scales the engine drops (NVFP4 input scales, dynamic-input FP8 ones:
`Rule.checked`), whose errors say which scale it is (`what`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freetoken.formats.fp8.block import E4M3_MAX, FP8
from freetoken.formats.shard import ShardError, fresh, whole


@dataclass(frozen=True)
class ScalarScale:
    """A per-tensor scale, () or (1,) in the checkpoint: every rank holds it whole as a
    float32 scalar; `shape` is the checkpoint's, which the inverse restores; `what` names the
    scale in errors (`NVFP4 input scale`, `FP8 per-tensor weight scale`)."""

    shape: tuple[int, ...] = ()
    what: str = "per-tensor FP8 scale"

    def _check(self, full: torch.Tensor, name: str) -> None:
        if not full.dtype.is_floating_point or tuple(full.shape) not in ((), (1,)):
            raise ShardError(f"{name}: {self.what} must be a float scalar, got "
                             f"{full.dtype} {tuple(full.shape)}")
        if full.is_meta:
            return
        value = float(full)
        if not math.isfinite(value) or value <= 0:
            raise ShardError(f"{name}: {self.what} {value} is not finite and above 0")

    def shard(self, full, rank, size, name=""):
        self._check(full, name)
        return fresh(full.float()).reshape(())

    def pieces(self, full, rank, size, name=""):
        self._check(full, name)
        return whole(full.reshape(()))

    def unshard(self, parts, name=""):
        return parts[0].reshape(self.shape)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 0-d scale = amax / 448), ModelOpt's rule; for tests and tiny
    checkpoints."""
    amax = float(w.abs().max())
    scale = torch.tensor(amax / E4M3_MAX if amax > 0 else 1.0, dtype=torch.float32)
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale
