"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode kernels: a
kernel launched with it may start while the stream's previous kernel finishes, once every
program of that one has let it (`jit_ops.launch_next`); it loads what no kernel in flight
writes (its weights) and then waits for the previous kernel (`jit_ops.grid_wait`) before it
reads an activation or writes anything. The NVFP4 experts' down launches so after their
gate_up (`nvfp4_mma_launch`), the 16-bit row kernels one after another (`gemv`).

Whether a launch may use it: `available`; the launch itself: `launch`, which finds out once
per process whether this Triton takes the `launch_pdl` option and otherwise launches
ordinarily."""

from __future__ import annotations

import functools

import torch

_SUPPORTED: dict[str, bool] = {}
"""{"supported": whether this Triton takes the `launch_pdl` launch option}, once a launch with
it was tried in this process."""


def capability(x: torch.Tensor) -> tuple[int, int]:
    """The compute capability of x's GPU."""
    return _device_capability(x.device.index if x.device.index is not None
                              else torch.cuda.current_device())


@functools.cache
def _device_capability(device_index: int) -> tuple[int, int]:
    """Asked once per device, not on every decode call."""
    return torch.cuda.get_device_capability(device_index)


def available(x: torch.Tensor) -> bool:
    """Whether a launch over x's device may use PDL: a GPU of compute capability 9.0+
    (`griddepcontrol`), unless an earlier launch found that this Triton cannot (`launch`)."""
    return x.is_cuda and capability(x) >= (9, 0) and _SUPPORTED.get("supported", True)


def pdl_args(on: bool) -> dict:
    """Kernel arguments for a launch with (or without) programmatic dependent launch: the
    kernel's PDL constexpr (its `launch_next` and `grid_wait`) and Triton's launch option."""
    return {"PDL": 1, "launch_pdl": True} if on else {}


def launch(kernel, grid, pdl: bool, **kwargs) -> None:
    """`kernel[grid](**kwargs)`, with programmatic dependent launch when `pdl`. The first such
    launch of the process finds out whether this Triton has the `launch_pdl` option (one
    without it rejects the unknown option, naming it, before compiling anything); without it
    that launch, and every later one, is an ordinary launch."""
    if pdl and _SUPPORTED.get("supported", True):
        try:
            kernel[grid](**kwargs, **pdl_args(True))
        except (KeyError, TypeError) as err:
            if "launch_pdl" not in str(err) or "supported" in _SUPPORTED:
                raise
            _SUPPORTED["supported"] = False
        else:
            _SUPPORTED["supported"] = True
            return
    kernel[grid](**kwargs)
