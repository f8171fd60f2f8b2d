"""Strict loading: every checkpoint tensor is consumed by exactly one rule, every parameter
element is written exactly once, shapes and dtypes are checked.

One copy per shard: each rank's shard goes from the memory-mapped checkpoint straight into its
parameter slot (on CPU a copy of a view; on a GPU by the copy engine from the registered file
pages, or through a pinned staging ring, small shards of one parameter batched into one
transfer), with any dtype cast fused into that copy; no shard is ever built on the side.
Everything is checked before the first byte is copied, then threads copy contiguous runs of
tensors (in file order, so each thread mostly reads one file front to back) in parallel."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from freetoken.distributed import TPInfo, get_tp_info
from freetoken.formats.quant.format import QUANTIZED_DTYPES
from freetoken.formats.shard import ShardPieces, ShardSpec, write_pieces
from freetoken.loading import staging
from freetoken.loading.checkpoint import CheckpointReader
from freetoken.loading.finite import check_finite, check_finite_grouped
from freetoken.loading.plan import ShardPlan, slot_key
from freetoken.loading.staging import MappedCheckpoint, PinnedStager, release_pinned

MAX_THREADS = 8
"""More threads than this stop paying: they contend for the same memory bus."""
SMALL_RUN_BYTES = 128 << 10
"""Onto a GPU, shards up to this size that fill adjacent bytes of one parameter (the scales and
norms of a quantized checkpoint, thousands of them) are assembled in one pinned buffer and
sent in one transfer, instead of one transfer (and its host-side cost) each. 0 turns it off."""
MAX_GPU_THREADS = 2
"""Loading onto a GPU, the copy engine reads the registered file pages itself and the threads
only plan and issue transfers, under the GIL: more than two contend (measured on an H200, a
5 GiB bf16 checkpoint: 0.60 s with 2 threads, 0.77 s with 4, 0.92 s with 8)."""

_observers: list[Callable[[str, bool], None]] = []

POST_LOAD_HOOKS: list[Callable[[nn.Module, CheckpointReader, ShardPlan], None]] = []
"""Functions `load_weights` calls as `hook(model, reader, plan)` once every shard is in place,
before it closes the reader, in the order appended. The engine registers none: the harness's
loader faults append one to leave the parameters as a loader with that bug would, where they
would otherwise replace `load_weights` wherever it was imported."""


class LoadError(ValueError):
    """A checkpoint does not fit the model it is loaded into."""


@dataclass(frozen=True, eq=False)
class _Job:
    """One checkpoint tensor and the parameter slot its shard goes to."""

    name: str
    full: torch.Tensor
    spec: ShardSpec
    pieces: ShardPieces
    dest: torch.Tensor
    param_name: str
    param: torch.Tensor
    nbytes: int


@contextlib.contextmanager
def observe_loading(callback: Callable[[str, bool], None]) -> Iterator[None]:
    """Call `callback(tensor_name, done)` before (done=False) and after (done=True) each
    tensor's copy, from the thread that copies it, while the block runs (memory checks
    use it to name the tensor in flight at a peak)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def default_threads(tp_size: int, gpu: bool = False) -> int:
    """Loader threads per rank: the host's cores shared by the ranks on it, after torch's
    own intra-op threads, at most MAX_THREADS (MAX_GPU_THREADS loading onto a GPU)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    most = MAX_GPU_THREADS if gpu else MAX_THREADS
    return max(1, min(most, (cores or 1) // (tp_size * torch.get_num_threads())))


def load_weights(model: nn.Module, reader: CheckpointReader, plan: ShardPlan,
                 progress: bool = True, threads: int | None = None) -> dict[str, int]:
    """Fill `model`'s parameters with this rank's shards, then run `POST_LOAD_HOOKS`; returns
    bytes read per tensor kind.

    Rank-dependent: each rank writes its own shard of every tensor. `plan` must be made for
    this rank's TP size (LoadError naming both sizes and the rank otherwise).
    """
    tp = get_tp_info()
    _check_plan_size(plan, tp)
    params = dict(model.named_parameters())
    device = next((p.device for p in params.values() if p.is_cuda), None)
    mapped = MappedCheckpoint(reader) if device is not None else None
    try:
        if mapped is not None:
            # The driver pins the pages of each planned tensor while this thread plans on.
            mapped.register_ahead(device)
        jobs, filled = _plan(params, reader, plan, tp.rank, tp.size,
                             None if mapped is None else mapped.ahead)
        if mapped is not None:
            mapped.ahead_done()
        _check_complete(params, filled)
        threads = threads or default_threads(tp.size, mapped is not None)
        bar = tqdm(total=len(jobs), desc="loading", unit="tensor",
                   disable=not (progress and tp.is_first and _on_a_terminal()), leave=False)
        spans = _spans(jobs, threads)
        with ThreadPoolExecutor(max_workers=len(spans) or 1, thread_name_prefix="load") as pool:
            for done in [pool.submit(_copy_span, span, reader, bar, mapped)
                         for span in spans]:
                done.result()
    finally:
        if mapped is not None:
            # Every stager finished (or failed) above: no transfer reads the pages any more.
            torch.cuda.synchronize()
            mapped.close()
            release_pinned()
    bar.close()
    for hook in list(POST_LOAD_HOOKS):
        hook(model, reader, plan)
    reader.close()
    return {p: sum(v.values()) for p, v in filled.items()}


def _check_plan_size(plan: ShardPlan, tp: TPInfo) -> None:
    """The plan's slots are cut for its TP size and each shard for the rank's: told apart
    here, once, a mismatch is not left to surface as some tensor's shape error."""
    if plan.tp_size != tp.size:
        raise LoadError(f"rank {tp.rank}: the shard plan is for tp_size={plan.tp_size}, but "
                        f"this rank is one of tp_size={tp.size}")


def _plan(params: dict, reader: CheckpointReader, plan: ShardPlan, rank: int, size: int,
          planned: Callable[[str], None] | None = None) -> tuple[list[_Job], dict]:
    """Every tensor's destination, checked (rule, parameter, shape, dtype, each slot once; a
    dropped tensor by its rule's `checked`) before anything is copied; `planned(name)` is
    told of each tensor that will be copied."""
    jobs, filled = [], defaultdict(dict)
    data = {}  # `.data` makes a new tensor object per call: one per parameter
    for name in reader.names():
        target = plan.resolve(name)
        if target.param is None:
            if target.rule.checked is not None:
                target.rule.check_dropped(reader.get(name), rank, size, name)
            continue
        if target.param not in params:
            raise LoadError(f"checkpoint tensor {name!r} maps to parameter {target.param!r}, "
                            "which the model does not have")
        full = reader.get(name)
        pieces = target.rule.spec.pieces(full, rank, size, name)
        param = data.get(target.param)
        if param is None:
            param = data[target.param] = params[target.param].data
        dest = param[target.slot] if target.slot else param
        _check_fit(name, pieces.shape, full.dtype, dest, target.param)
        key = slot_key(target.slot)
        if key in filled[target.param]:
            raise LoadError(f"parameter {target.param!r} slot {key} written twice "
                            f"(second time by {name!r})")
        filled[target.param][key] = dest.numel()
        # `full` maps the file (no bytes are read until the copy): kept, not read twice.
        jobs.append(_Job(name, full, target.rule.spec, pieces, dest, target.param, param,
                         dest.numel() * dest.element_size()))
        if planned is not None:
            planned(name)
    return jobs, filled


def _spans(jobs: list[_Job], threads: int) -> list[list[_Job]]:
    """At most `threads` contiguous runs of `jobs` with about equal bytes each."""
    total = sum(j.nbytes for j in jobs)
    spans, current, size = [], [], 0
    for job in jobs:
        current.append(job)
        size += job.nbytes
        if size * threads >= total * (len(spans) + 1) and len(spans) < threads - 1:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def _copy_span(span: list[_Job], reader: CheckpointReader, bar,
               mapped: MappedCheckpoint | None = None) -> None:
    """Copy one run of tensors into their slots (runs in a loader thread)."""
    stager = _make_stager(span, reader, mapped)
    if stager is None:
        for job in span:
            _copy_job(job, None)
            bar.update(1)
        return
    runs, singles = _small_runs(span, stager.buffer_bytes)
    with stager.current():
        for run in runs:
            _copy_run(run, stager)
            bar.update(len(run))
        for job in singles:
            _copy_job(job, stager)
            bar.update(1)
    stager.finish()
    # Staged copies run on the stager's stream: checked once they have all landed.
    check_finite_grouped(_finite_groups(span))


def _make_stager(span: list[_Job], reader: CheckpointReader,
                 mapped: MappedCheckpoint | None) -> PinnedStager | None:
    """The span's stager on its GPU (a ring no larger than the span's largest shard: small
    models pin little); None for parameters on the CPU, which are copied into in place."""
    if not span[0].dest.is_cuda:
        return None
    largest = max(job.nbytes for job in span)
    return PinnedStager(span[0].dest.device, reader, min(staging.STAGE_BYTES, largest),
                        mapped=mapped)


def _finite_groups(span: list[_Job]) -> list[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]:
    """The span's shards grouped by parameter for the finite screen: a parameter the span
    fills entirely is screened in one reduction (NVFP4 checkpoints have thousands of scale
    tensors in a few parameters); one only partly here (another thread writes the rest, or
    not yet) shard by shard."""
    by_param: dict[str, list[_Job]] = defaultdict(list)
    for job in span:
        by_param[job.param_name].append(job)
    groups = []
    for jobs in by_param.values():
        param, named = jobs[0].param, [(job.name, job.dest) for job in jobs]
        if sum(job.nbytes for job in jobs) == param.numel() * param.element_size():
            groups.append((param, named))
        else:
            groups.extend((dest, [(name, dest)]) for name, dest in named)
    return groups


@contextlib.contextmanager
def _in_flight(name: str) -> Iterator[None]:
    """Tell the observers (`observe_loading`) that tensor `name` is being copied."""
    for observe in list(_observers):
        observe(name, False)
    yield
    for observe in list(_observers):
        observe(name, True)


def _copy_job(job: _Job, stager: PinnedStager | None) -> None:
    with _in_flight(job.name):
        _copy_shard(job, stager)


def _copy_run(run: list[_Job], stager: PinnedStager) -> None:
    """Shards filling adjacent bytes of one parameter: one pinned buffer, one transfer."""
    first, nbytes = run[0], sum(job.nbytes for job in run)
    at = first.dest.data_ptr() - first.param.data_ptr()
    target = first.param.reshape(-1).view(torch.uint8)[at : at + nbytes]
    with stager.assemble(target) as buffer:
        done = 0
        for job in run:
            with _in_flight(job.name):
                host = buffer[done : done + job.nbytes].view(job.dest.dtype).view(
                    job.pieces.shape)
                write_pieces(job.pieces, host)
            done += job.nbytes


def _small_runs(span: list[_Job], most: int) -> tuple[list[list[_Job]], list[_Job]]:
    """(runs of two or more small shards that fill adjacent bytes of one contiguous parameter,
    at most `most` bytes each; every other job)."""
    small = sorted((job for job in span if job.nbytes <= SMALL_RUN_BYTES
                    and job.dest.is_contiguous() and job.param.is_contiguous()),
                   key=lambda job: job.dest.data_ptr())
    runs, current, total = [], [], 0
    for job in small:
        if current and (job.param_name != current[0].param_name
                        or job.dest.data_ptr() != current[-1].dest.data_ptr()
                        + current[-1].nbytes or total + job.nbytes > most):
            runs.append(current)
            current, total = [], 0
        current.append(job)
        total += job.nbytes
    runs = [run for run in [*runs, current] if len(run) > 1]
    batched = {id(job) for run in runs for job in run}
    return runs, [job for job in span if id(job) not in batched]


def _copy_shard(job: _Job, stager: PinnedStager | None) -> None:
    """The one copy of a shard: from the mapped checkpoint into its slot (the pieces were
    made and checked by `_plan`)."""
    if stager is None:
        write_pieces(job.pieces, job.dest)
        check_finite(job.name, job.dest)
    else:
        stager.write(job.name, job.full, job.pieces, job.dest)


def _check_fit(name: str, shape: tuple, dtype: torch.dtype, dest: torch.Tensor,
               param: str) -> None:
    if tuple(shape) != tuple(dest.shape):
        raise LoadError(f"checkpoint tensor {name!r}: shard shape {tuple(shape)} does not "
                        f"fit parameter {param!r} slot of shape {tuple(dest.shape)}")
    if dtype.is_floating_point != dest.dtype.is_floating_point:
        raise LoadError(f"checkpoint tensor {name!r}: dtype {dtype} cannot fill "
                        f"parameter {param!r} of dtype {dest.dtype}")
    if dest.dtype in QUANTIZED_DTYPES and dtype != dest.dtype:
        raise LoadError(f"checkpoint tensor {name!r} is {dtype}, but the quantization config "
                        f"makes parameter {param!r} {dest.dtype}: the checkpoint does not hold "
                        "the format its config declares")
    if dtype in QUANTIZED_DTYPES and dtype != dest.dtype:
        # A cast would drop the scales that give these values meaning: garbage, silently.
        raise LoadError(f"checkpoint tensor {name!r} is {dtype}, quantized data, but "
                        f"parameter {param!r} is an unquantized {dest.dtype}: the "
                        "quantization config does not declare this module quantized")


def _check_complete(params: dict, filled: dict) -> None:
    missing = [n for n, p in params.items() if sum(filled.get(n, {}).values()) != p.numel()]
    if missing:
        shown = ", ".join(
            f"{n} ({sum(filled.get(n, {}).values())}/{params[n].numel()} elements)"
            for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"parameters not filled by the checkpoint: {shown}{more}")


def _on_a_terminal() -> bool:
    """The loading bar redraws itself with carriage returns: drawn only for a person at a
    terminal, never into a log or a captured stream."""
    return sys.stderr.isatty()

