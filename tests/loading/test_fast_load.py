"""The loader's fast path (each shard copied once, straight from the mapped checkpoint into its
parameter slot) gives bitwise the parameters of the shard() path (a fresh shard per tensor,
then copied), on every bundled case at TP 1, 2, 4 and 8, in the checkpoint's dtype and with a
cast to bf16 fused into the copy. Ranks are simulated in one process (`set_tp_info`): loading
is a pure function of (checkpoint, rank, size)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from freetoken.config import ModelConfig
from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.shard import write_pieces
from freetoken.formats.specs import (
    Heads,
    InterleavedHeads,
    PaddedSplit,
    Replicate,
    Segments,
    Split,
)
from freetoken.loading import CheckpointReader, LoadError, load_weights, loader
from freetoken.loading.staging import FileReader, _row_pieces, fill
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.cases.catalogue import CASES, GOLDEN
from freetoken_verify.faults.memory import double_copy_load

TP_SIZES = (1, 2, 4, 8)


def _build(cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The rank-local model with every float parameter NaN, so an unwritten element shows."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model(cfg)
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():
        p.data.fill_(float("nan") if p.dtype.is_floating_point else 0xA5)
    return model


def _load(folder, cfg, tp: int, rank: int, dtype: torch.dtype, threads: int,
          device: str = "cpu") -> dict:
    set_tp_info(TPInfo(rank, tp))
    try:
        with torch.device(device):
            model = _build(cfg, dtype)
        load_weights(model, CheckpointReader(folder), shard_plan(cfg, tp), progress=False,
                     threads=threads)
    finally:
        reset_tp_info()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def double_copied(monkeypatch, folder, cfg, tp: int, rank: int, dtype: torch.dtype) -> dict:
    """A CPU load through the old double-copy path (the `double-copy-load` fault), the real
    loader restored afterwards."""
    with monkeypatch.context() as patched:
        patched.setattr(loader, "_copy_shard", loader._copy_shard)
        patched.setattr(loader, "SMALL_RUN_BYTES", loader.SMALL_RUN_BYTES)
        double_copy_load()
        return _load(folder, cfg, tp, rank, dtype, threads=1)


def _assert_bitwise_same(fast: dict, slow: dict, label: str) -> None:
    assert fast.keys() == slow.keys(), label
    for name, want in slow.items():
        same = _bytes(fast[name]).equal(_bytes(want))
        assert same, f"{label}: {name} differs between the fast path and the shard() path"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_shard_path_on_bundled_cases(case, dtype, monkeypatch):
    """Every parameter of every rank at TP 1, 2, 4, 8 is bitwise the same either way."""
    folder = GOLDEN / case
    cfg = load_config(folder)
    for tp in TP_SIZES:
        for rank in range(tp):
            fast = _load(folder, cfg, tp, rank, dtype, threads=3)
            slow = double_copied(monkeypatch, folder, cfg, tp, rank, dtype)
            _assert_bitwise_same(fast, slow, f"{case} {dtype} tp={tp} rank={rank}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_staging_matches_shard_path_on_bundled_cases(case, monkeypatch):
    """Loaded onto the GPU through the pinned staging ring (buffers small enough that shards
    go in several chunks), every parameter is bitwise the shard() path's, in bf16."""
    from freetoken.loading import staging

    folder = GOLDEN / case
    cfg = load_config(folder)
    monkeypatch.setattr(staging, "STAGE_BYTES", 4096)
    for tp in TP_SIZES:
        for rank in range(tp):
            fast = _load(folder, cfg, tp, rank, torch.bfloat16, threads=3, device="cuda")
            slow = double_copied(monkeypatch, folder, cfg, tp, rank, torch.bfloat16)
            _assert_bitwise_same(fast, slow, f"{case} cuda tp={tp} rank={rank}")


class _HostStager:
    """The GPU stager's contract on the host, for what the loader's GPU branch drives (small
    runs assembled in one buffer, single shards, the copy stream, the finish) with plain CPU
    copies: the branch's bookkeeping is then checked here, the transfers on a GPU."""

    def __init__(self, buffer_bytes: int = 1 << 20):
        self.buffer_bytes = buffer_bytes
        self.runs = 0

    @contextlib.contextmanager
    def current(self):
        yield

    @contextlib.contextmanager
    def assemble(self, dest: torch.Tensor):
        buffer = torch.full((dest.numel(),), 0xA5, dtype=torch.uint8)
        yield buffer
        dest.copy_(buffer)
        self.runs += 1

    def write(self, name, full, pieces, dest) -> None:
        write_pieces(pieces, dest)

    def finish(self) -> None:
        pass


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_branch_on_the_host_matches_the_shard_path(case, monkeypatch):
    """The loader's GPU branch (small runs, single shards, the finite screen per parameter),
    driven with a host stand-in for the pinned stager and a 4 KiB ring so runs are cut, with
    three threads: every parameter bitwise the shard() path's at TP 1, 2, 4 and 8."""
    folder = GOLDEN / case
    cfg = load_config(folder)
    stagers = []

    def host_stager(span, reader, mapped):
        stagers.append(_HostStager(min(4096, max(job.nbytes for job in span))))
        return stagers[-1]

    for tp in TP_SIZES:
        for rank in range(tp):
            with monkeypatch.context() as patched:
                patched.setattr(loader, "_make_stager", host_stager)
                fast = _load(folder, cfg, tp, rank, torch.bfloat16, threads=3)
            slow = double_copied(monkeypatch, folder, cfg, tp, rank, torch.bfloat16)
            _assert_bitwise_same(fast, slow, f"{case} gpu branch tp={tp} rank={rank}")
    assert sum(s.runs for s in stagers), f"{case}: no run of small shards was batched"


def test_gpu_branch_names_a_nan_in_a_batched_scale(tmp_path, monkeypatch):
    """A NaN in one NVFP4 block-scale tensor (a shard the GPU branch batches with its
    neighbours and screens with its whole parameter) stops the load naming that tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from freetoken.loading.finite import NonFiniteError

    folder = tmp_path / "nvfp4"
    shutil.copytree(GOLDEN / "tiny-qwen3.5-moe-nvfp4", folder)
    tensors = load_file(folder / "model.safetensors")
    victim = "model.language_model.layers.0.mlp.experts.3.up_proj.weight_scale"
    tensors[victim].view(torch.uint8).view(-1)[5] = 0x7F  # float8_e4m3fn NaN
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(loader, "_make_stager", lambda span, reader, mapped: _HostStager())
    with pytest.raises(NonFiniteError, match=re.escape(repr(victim))):
        _load(folder, load_config(folder), 1, 0, torch.bfloat16, threads=2)


def _planned(folder, cfg, tp: int, rank: int) -> tuple[torch.nn.Module, list]:
    """A rank's NaN-filled bf16 model and the loader's jobs for it (nothing copied yet)."""
    set_tp_info(TPInfo(rank, tp))
    try:
        model = _build(cfg, torch.bfloat16)
        params = dict(model.named_parameters())
        jobs, _ = loader._plan(params, CheckpointReader(folder), shard_plan(cfg, tp), rank, tp)
    finally:
        reset_tp_info()
    return model, jobs


@pytest.mark.parametrize("case", sorted(CASES))
def test_small_runs_assemble_bitwise_the_shard_path(case):
    """Small shards batched into one buffer per run of adjacent slots (what the GPU loader
    sends in one transfer) give bitwise the shard() path's parameters at TP 1, 2, 4 and 8;
    the runs cover only small jobs, each job once, with adjacent slots of one parameter."""
    folder = GOLDEN / case
    cfg = load_config(folder)
    batched_somewhere = False
    for tp in TP_SIZES:
        for rank in range(tp):
            want = _load(folder, cfg, tp, rank, torch.bfloat16, threads=1)
            model, jobs = _planned(folder, cfg, tp, rank)
            runs, singles = loader._small_runs(jobs, 1 << 20)
            assert sorted(map(id, [j for r in runs for j in r] + singles)) == \
                sorted(map(id, jobs)), "runs and singles do not partition the jobs"
            for run in runs:
                assert all(j.nbytes <= loader.SMALL_RUN_BYTES for j in run)
                loader._copy_run(run, _HostStager())
            for job in singles:
                loader._copy_job(job, None)
            batched_somewhere |= bool(runs)
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
            _assert_bitwise_same(got, want, f"{case} batched tp={tp} rank={rank}")
    assert batched_somewhere, f"{case}: no run of small shards to batch at any TP size"


def test_finite_screen_per_parameter_names_the_tensor():
    """The GPU loader screens a parameter its thread filled entirely in one reduction (far
    fewer than one per tensor on NVFP4), and a NaN in one shard is still reported under that
    shard's checkpoint name; a finite parameter whose sum overflows is not refused."""
    from freetoken.loading.finite import NonFiniteError, check_finite_grouped

    folder = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
    cfg = load_config(folder)
    _, jobs = _planned(folder, cfg, 1, 0)
    for job in jobs:
        loader._copy_job(job, None)
    groups = loader._finite_groups(jobs)
    assert sorted(n for _, parts in groups for n, _ in parts) == sorted(j.name for j in jobs)
    assert len(groups) < len(jobs) / 2, f"{len(groups)} screens for {len(jobs)} tensors"
    check_finite_grouped(groups)
    victim = next(j for j in jobs if j.dest.dtype == torch.float32 and j.dest.numel() == 1
                  and any(len(parts) > 1 and j.name in dict(parts) for _, parts in groups))
    victim.dest.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=re.escape(repr(victim.name))):
        check_finite_grouped(groups)
    big = torch.full((4, 1024), 3e38)
    check_finite_grouped([(big, [(f"t{i}", big[i]) for i in range(4)])])


SPECS = [
    (Replicate(), (6, 5)), (Split(0), (8, 5)), (Split(1), (6, 8)),
    (Segments((4, 8, 4)), (16, 3)), (Segments((4, 8, 4), dim=1), (5, 16)),
    (Heads(2), (8, 3)), (PaddedSplit(7), (7, 3)), (InterleavedHeads(4), (16, 3)),
]


@pytest.mark.parametrize("spec, shape", SPECS, ids=lambda v: repr(v))
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_staging_chunks_reassemble_the_shard(spec, shape, rows):
    """The GPU path stages a shard `rows` rows at a time; the pieces restricted to each chunk
    fill exactly that chunk of the shard (checked on CPU: the chunking is device-free)."""
    full = torch.randn(shape)
    for rank in range(4):
        want = spec.shard(full, rank, 4, "t")
        pieces = spec.pieces(full, rank, 4, "t")
        got = torch.full(want.shape, float("nan"))
        for first in range(0, want.shape[0], rows):
            stop = min(first + rows, want.shape[0])
            stage = torch.full((stop - first, *want.shape[1:]), float("nan"))
            for region, source in _row_pieces(pieces, first, stop, stage):
                region.copy_(source) if source is not None else region.zero_()
            got[first:stop] = stage
        assert torch.equal(got, want), f"{spec} rank {rank} in chunks of {rows} rows"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_staging_fill_reads_the_file_bitwise(case, dtype):
    """Staging chunks of 3 rows, filled by reading the file where rows lie contiguously (in the
    checkpoint's dtype) and by copying from the mapped view elsewhere (casts, column splits),
    reassemble every shard of every bundled tensor at TP 1, 2, 4, 8 bit for bit."""
    folder = GOLDEN / case
    cfg = load_config(folder)
    reader = CheckpointReader(folder)
    files = FileReader(reader)
    try:
        for tp in TP_SIZES:
            plan = shard_plan(cfg, tp)
            for name in reader.names():
                full = reader.get(name)
                spec = plan.resolve(name).rule.spec
                for rank in range(tp):
                    # Compared as bytes: a column-split block scale's shard ([3, 1] of a
                    # [3, 4] grid) has no [-1, *full.shape[1:]] form.
                    want = spec.shard(full, rank, tp, name)
                    kind = dtype if dtype and full.dtype.is_floating_point else full.dtype
                    got = _staged(spec, full, rank, tp, name, kind, files)
                    label = f"{case} {name} tp={tp} rank={rank}"
                    assert _bytes(got).equal(_bytes(want.to(kind))), label
    finally:
        files.close()
        reader.close()


def _staged(spec, full, rank, size, name, dtype, files, rows=3):
    from freetoken.loading.staging import _as_rows

    pieces = _as_rows(spec.pieces(full, rank, size, name))
    out = torch.empty(pieces.shape, dtype=dtype)
    origin = files.origin(name, full)
    for first in range(0, pieces.shape[0], rows):
        stop = min(first + rows, pieces.shape[0])
        stage = torch.empty((stop - first, *pieces.shape[1:]), dtype=dtype)
        fill(stage, pieces, first, stop, files, origin)
        out[first:stop] = stage
    return out


def test_a_plan_for_another_tp_size_is_refused_naming_both_sizes_and_the_rank():
    """Rank 1 of 2 handed the plan of TP 4 stops before anything is planned or copied, with
    an error naming the plan's size, the rank's and the rank."""
    folder = GOLDEN / "tiny-llama"
    cfg = load_config(folder)
    set_tp_info(TPInfo(1, 2))
    try:
        model = _build(cfg, torch.float32)
        with pytest.raises(LoadError, match=r"rank 1: the shard plan is for tp_size=4, but "
                                            r"this rank is one of tp_size=2"):
            load_weights(model, CheckpointReader(folder), shard_plan(cfg, 4), progress=False)
    finally:
        reset_tp_info()
