"""On a GPU, shards that lie contiguously in the file in the parameter's dtype are copied by
the copy engine straight from the registered file pages (`freetoken.loading.mapped`); the rest,
and everything when the registration is refused, through the pinned staging rings. Either way
every parameter of every rank is bitwise the shard() path's, on every bundled case."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.loading import CheckpointReader, load_weights, loader, mapped, staging
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.cases.catalogue import CASES, GOLDEN
from freetoken_verify.faults.memory import double_copy_load

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _checkpoint_dtype(folder) -> torch.dtype:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return next(f.get_tensor(k).dtype for k in f.keys()
                    if f.get_tensor(k).dtype.is_floating_point)


def _load(folder, cfg, tp, rank, dtype, device) -> dict:
    set_tp_info(TPInfo(rank, tp))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg)
        for p in model.parameters():
            p.data.fill_(float("nan") if p.dtype.is_floating_point else 0xA5)
        load_weights(model, CheckpointReader(folder), shard_plan(cfg, tp), progress=False,
                     threads=3)
    finally:
        torch.set_default_dtype(previous)
        reset_tp_info()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _assert_bitwise_same(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), label
    for name, w in want.items():
        same = got[name].reshape(-1).view(torch.uint8).equal(w.reshape(-1).view(torch.uint8))
        assert same, f"{label}: {name} differs from the shard() path"


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "refused"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_registered_pages_load_bitwise(case, registered, monkeypatch):
    """Direct copies happen when the registration succeeds (and none when refused), and the
    parameters are the shard() path's bit for bit at TP 1, 2, 4, with registration windows
    of one page, so tensors cross windows and are copied in several transfers."""
    folder = GOLDEN / case
    cfg = load_config(folder)
    dtype = _checkpoint_dtype(folder)
    direct = []
    segments = mapped.MappedCheckpoint.segments

    def counted(self, *args):
        out = segments(self, *args)
        direct.append(out is not None)
        return out

    monkeypatch.setattr(mapped.MappedCheckpoint, "segments", counted)
    # One page per registration and small chunks: tensors span windows and go in pieces.
    monkeypatch.setattr(mapped, "REGISTER_WINDOW", 4096)
    monkeypatch.setattr(staging, "STAGE_BYTES", 8192)
    if not registered:
        monkeypatch.setattr(mapped._MappedFile, "register", lambda self, a, b: False)
    # The bundled tensors are small: batched into pinned runs they would never reach the
    # registered pages this test is about (test_fast_load covers the runs on the GPU).
    monkeypatch.setattr(loader, "SMALL_RUN_BYTES", 0)
    for tp in (1, 2, 4):
        for rank in range(tp):
            fast = _load(folder, cfg, tp, rank, dtype, "cuda")
            with monkeypatch.context() as patched:  # the real loader back afterwards
                patched.setattr(loader, "_copy_shard", loader._copy_shard)
                double_copy_load()
                slow = _load(folder, cfg, tp, rank, dtype, "cpu")
            _assert_bitwise_same(fast, slow, f"{case} tp={tp} rank={rank} {dtype}")
    assert any(direct) == registered, f"{case}: direct copies {sum(direct)} of {len(direct)}"
