"""Shard specs for NVFP4 tensors, in the style of `freetoken.formats.specs`: pure functions of
(full checkpoint tensor, rank, size, name) returning a fresh, contiguous tensor, each with its
bitwise inverse, and a `pieces` method giving the views of the full tensor the loader copies
straight into the parameter (see `freetoken.formats.shard.shard_into`).

Output rows (gate_proj / up_proj rows, the rows of their block scales) split like any weight:
use `Split(0)`, or `Segments` for a fused gate|up tensor. Input columns are different: the
packed weight holds 2 inputs per byte and the block scale 1 column per 16 inputs, so a split
of the logical input dimension must fall on a 16-element group boundary (`InputSplit`).
Global scales are per tensor: replicated, and kept float32 (`GlobalScale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freetoken.formats.nvfp4.format import GROUP
from freetoken.formats.shard import ShardError, fresh, whole

PACKED, SCALE = "packed", "scale"
_INPUTS_PER_COLUMN = {PACKED: 2, SCALE: GROUP}
_WHAT = {PACKED: "packed bytes", SCALE: "block-scale columns"}


def local_inputs(full_inputs: int, size: int, name: str) -> int:
    """Inputs per rank for `full_inputs` split across `size` ranks; ShardError naming `name`
    unless every rank's share is a whole number of 16-element groups."""
    if full_inputs % (size * GROUP):
        raise ShardError(f"{name}: {full_inputs} NVFP4 inputs cannot be split across "
                         f"tp_size={size}: {full_inputs / size:g} per rank is not a multiple "
                         f"of the {GROUP}-element group")
    return full_inputs // size


@dataclass(frozen=True)
class InputSplit:
    """Split the input (last by default) dim of a packed NVFP4 weight (`kind="packed"`,
    uint8, 2 inputs per column) or of its block scale (`kind="scale"`, 16 inputs per
    column) into equal, group-aligned chunks; rank r takes chunk r."""

    kind: str = PACKED
    dim: int = -1

    def __post_init__(self):
        if self.kind not in _INPUTS_PER_COLUMN:
            raise ValueError(f"InputSplit kind must be {PACKED!r} or {SCALE!r}, "
                             f"got {self.kind!r}")

    def _view(self, full: torch.Tensor, rank: int, size: int, name: str) -> torch.Tensor:
        per_column = _INPUTS_PER_COLUMN[self.kind]
        columns = full.shape[self.dim]
        try:
            local = local_inputs(columns * per_column, size, name)
        except ShardError as e:
            raise ShardError(f"{e} ({name} dim {self.dim} has {columns} "
                             f"{_WHAT[self.kind]}, shape {tuple(full.shape)})") from None
        step = local // per_column
        return full.narrow(self.dim, rank * step, step)

    def shard(self, full: torch.Tensor, rank: int, size: int, name: str = "") -> torch.Tensor:
        return fresh(self._view(full, rank, size, name))

    def pieces(self, full, rank, size, name=""):
        return whole(self._view(full, rank, size, name))

    def unshard(self, parts: list[torch.Tensor], name: str = "") -> torch.Tensor:
        return torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class GlobalScale:
    """A per-tensor global scale (`weight_scale_2`, CT's `weight_global_scale`): every rank
    holds it whole, as a float32 scalar. Both scalar shapes are read, since real checkpoints
    of either producer use both; `shape` is the one the producer usually writes (ModelOpt: a
    0-dim tensor, compressed-tensors: [1]), which the inverse restores."""

    shape: tuple[int, ...] = ()

    def _check(self, full: torch.Tensor, name: str) -> None:
        if full.dtype != torch.float32:
            raise ShardError(f"{name}: NVFP4 global scale must be float32, got {full.dtype}")
        if tuple(full.shape) not in ((), (1,)):
            raise ShardError(f"{name}: NVFP4 global scale has shape {tuple(full.shape)}, "
                             "expected a scalar, () or (1,)")
        if full.is_meta:
            return
        value = float(full)
        if not math.isfinite(value) or value < 0:
            # A NaN global scale otherwise loads and turns every weight of the tensor to NaN.
            what = "NaN" if math.isnan(value) else "Inf" if math.isinf(value) else "negative"
            raise ShardError(f"{name}: NVFP4 global scale holds {what} ({value})")

    def shard(self, full: torch.Tensor, rank: int, size: int, name: str = "") -> torch.Tensor:
        self._check(full, name)
        return fresh(full).reshape(())

    def pieces(self, full, rank, size, name=""):
        self._check(full, name)
        return whole(full.reshape(()))

    def unshard(self, parts: list[torch.Tensor], name: str = "") -> torch.Tensor:
        return parts[0].reshape(self.shape)
