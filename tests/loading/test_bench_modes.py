"""`bench/load.py`'s baselines are what they say: in `view` mode every spec's shard is a view
of the checkpoint tensor (the reference the loader's speed goal is measured against), in
`clone` mode a fresh copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from freetoken.formats import specs
from freetoken.formats.nvfp4 import specs as nvfp4_specs
from freetoken.loading import loader

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_load(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    # Whatever a mode patches is put back after the test.
    for module, name in ((loader, "_copy_shard"), (loader, "SMALL_RUN_BYTES"),
                         (specs, "fresh"), (nvfp4_specs, "fresh")):
        monkeypatch.setattr(module, name, getattr(module, name))
    import load

    yield load
    sys.modules.pop("load", None)


@pytest.mark.parametrize("mode, shares", [("view", True), ("clone", False)])
def test_view_mode_shards_are_views_and_clone_mode_copies(bench_load, mode, shares):
    full = torch.arange(64.0).reshape(8, 8)
    scale = torch.tensor(2.0)
    bench_load._use_mode(None, mode)
    for label, shard, source in [
            ("Split(0)", specs.Split(0).shard(full, 1, 2), full),
            ("Split(1)", specs.Split(1).shard(full, 1, 2), full),
            ("Replicate", specs.Replicate().shard(full, 0, 2), full),
            ("GlobalScale", nvfp4_specs.GlobalScale().shard(scale, 0, 2), scale)]:
        same = shard.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        assert same == shares, f"{mode}: {label} shard {'copied' if shares else 'is a view'}"
