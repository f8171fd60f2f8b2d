"""Where TP ranks run: the placement policy of the design."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PlacementError(ValueError):
    """The requested device and TP size cannot be placed on this machine."""


@dataclass(frozen=True)
class Placement:
    """How a rank group is laid out: `cpu-gloo`, `cuda-nccl` or `cuda-shared-gloo`."""

    name: str
    num_gpus: int = 0

    @property
    def backend(self) -> str:
        return "nccl" if self.name == "cuda-nccl" else "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.name != "cpu-gloo"

    def device_for(self, rank: int) -> torch.device:
        """The device rank `rank` computes on (round-robin over GPUs when they are shared)."""
        if not self.is_cuda:
            return torch.device("cpu")
        return torch.device("cuda", rank % self.num_gpus)


def resolve_device(device: str) -> str:
    """`auto` becomes `cuda` when a GPU is visible, else `cpu`."""
    if device not in ("auto", "cpu", "cuda"):
        raise PlacementError(f"unknown device {device!r}; expected auto, cpu or cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PlacementError("device=cuda requested but no CUDA device is visible")
    return device


def choose_placement(device: str, tp_size: int, oversubscribe: bool = False) -> Placement:
    """Pick the placement for `tp_size` ranks on `device` (auto, cpu or cuda)."""
    if tp_size < 1:
        raise PlacementError(f"tp_size must be >= 1, got {tp_size}")
    device = resolve_device(device)
    if device == "cpu":
        return Placement("cpu-gloo")
    gpus = torch.cuda.device_count()
    if gpus >= tp_size:
        return Placement("cuda-nccl", gpus)
    if oversubscribe:
        return Placement("cuda-shared-gloo", gpus)
    raise PlacementError(
        f"tp_size={tp_size} needs {tp_size} GPUs for NCCL but {gpus} visible; "
        "pass --oversubscribe to share GPUs between gloo ranks"
    )
