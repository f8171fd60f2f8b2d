"""NVFP4 layers and backend choice: the CPU default is the torch reference, a refused backend
says why (naming TRITON_INTERPRET, the dtype, or the size that is not a whole group), the
choice is made once per configuration, and experts refuse a split that cuts a group."""

from __future__ import annotations

import pytest
import torch

from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.shard import ShardError
from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts
from freetoken.layers.quantization.nvfp4.backend import (
    BackendError,
    choose_backend,
    triton_unavailable_reason,
)


def test_cpu_defaults_to_torch_and_triton_refusals_say_why(monkeypatch):
    """auto on CPU -> torch; triton on CPU needs TRITON_INTERPRET=1 and float32; sizes must be
    whole 16-element groups; an unknown backend name is refused."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    choice = choose_backend("cpu", torch.float32, 64, 32)
    assert choice.name == "torch" and "CPU default" in choice.reason
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        choose_backend("cpu", torch.float32, 64, 32, requested="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_backend("cpu", torch.float32, 64, 32, requested="triton").name == "triton"
    with pytest.raises(BackendError, match="bfloat16.*float32 activations"):
        choose_backend("cpu", torch.bfloat16, 64, 32, requested="triton")
    reason = triton_unavailable_reason("cpu", torch.float32, 64, 40)
    assert "TP-local intermediate size 40" in reason and "16-element" in reason
    with pytest.raises(BackendError, match="'cutlass'"):
        choose_backend("cpu", torch.float32, 64, requested="cutlass")


def test_backend_is_decided_once_per_configuration(monkeypatch):
    """Layers ask for their backend on every forward: the decision (triton's presence, the
    device) is made once per configuration, and again only for a new configuration or a
    changed interpreter switch."""
    from freetoken.layers.quantization.nvfp4 import backend

    calls = []
    decide = backend.triton_unavailable_reason
    monkeypatch.setattr(backend, "triton_unavailable_reason",
                        lambda *args: calls.append(args) or decide(*args))
    backend._choose.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for _ in range(3):
        choose_backend("cpu", torch.float32, 64, 32)
    assert len(calls) == 1, f"3 identical choices decided {len(calls)} times"
    choose_backend("cpu", torch.float32, 64, 48)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_backend("cpu", torch.float32, 64, 32).name == "torch"
    assert len(calls) == 3, f"2 new configurations decided {len(calls) - 1} times"
    backend._choose.cache_clear()


def test_experts_refuse_an_intermediate_that_cuts_groups():
    """moe_intermediate_size=96 at tp=4 gives 24 per rank: not whole groups, named."""
    reset_tp_info()
    set_tp_info(TPInfo(0, 4))
    try:
        with pytest.raises(ShardError, match="moe_intermediate_size: 96 .*tp_size=4.*24 per"):
            NVFP4FusedExperts(4, 64, 96)
    finally:
        reset_tp_info()
