"""Tests for freetoken.distributed: rank groups (launch), placement, communicator and TP info."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from freetoken.distributed import (
    Placement,
    PlacementError,
    RankError,
    RankGroup,
    RankTimeout,
    TPInfo,
    acting_as,
    choose_placement,
    divide,
    get_communicator,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
)

_EXIT_WAIT_S = 5.0


# --- functions run on ranks (module level: they are pickled to forkserver workers) ---------


def _rank_pid(ctx) -> int:
    return os.getpid()


def _rank_identity(ctx) -> tuple[int, int, int, int]:
    info = get_tp_info()
    return ctx.rank, ctx.size, info.rank, info.size


def _rank_collectives(ctx) -> dict:
    comm = get_communicator()
    reduced = comm.all_reduce(torch.tensor([float(ctx.rank + 1), 10.0 * ctx.rank]))
    gathered = comm.all_gather(torch.full((2, 1), float(ctx.rank)), dim=-1)
    gathered0 = comm.all_gather(torch.tensor([[ctx.rank, -ctx.rank]]), dim=0)
    src = ctx.size - 1
    value = torch.tensor([100.0 + src]) if ctx.rank == src else torch.zeros(1)
    broadcast = comm.broadcast(value, src=src)
    return {"reduced": reduced.tolist(), "gathered": gathered.tolist(),
            "gathered0": gathered0.tolist(), "broadcast": broadcast.tolist()}


def _rank_count_calls(ctx) -> int:
    ctx.state["calls"] = ctx.state.get("calls", 0) + 1
    return ctx.state["calls"]


def _rank_raise_on_one(ctx) -> int:
    if ctx.rank == 1:
        raise KeyError("shard of layers.3.mlp missing")
    time.sleep(120)
    return ctx.rank


def _rank_sleep_on(ctx, ranks: tuple[int, ...]) -> int:
    if ctx.rank in ranks:
        time.sleep(120)
    return ctx.rank


# --- helpers ---------------------------------------------------------------------------------


def _make_group(tp_size: int, timeout: float = 120.0) -> RankGroup:
    return RankGroup(tp_size, choose_placement("cpu", tp_size), timeout=timeout)


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _assert_all_gone(pids: list[int], what: str, within: float = _EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(_is_gone(p) for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if not _is_gone(p)]
    assert not alive, f"{what}: processes {alive} still alive {within:.0f}s later"
    children = {c.pid for c in psutil.Process().children(recursive=True) if not _is_gone(c.pid)}
    assert not children & set(pids), f"{what}: {children & set(pids)} still children of the test"


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if not _is_gone(pid):
            psutil.Process(pid).kill()


def _assert_collectives(results: list[dict], size: int) -> None:
    expected = {
        "reduced": [float(sum(range(1, size + 1))), 10.0 * sum(range(size))],
        "gathered": [[float(r) for r in range(size)]] * 2,
        "gathered0": [[r, -r] for r in range(size)],
        "broadcast": [100.0 + size - 1],
    }
    for rank, got in enumerate(results):
        for name, want in expected.items():
            assert got[name] == want, f"{name} on rank {rank}/{size}: got {got[name]}, want {want}"


@pytest.fixture(scope="module")
def group2():
    with _make_group(2) as group:
        yield group


# --- rank groups -----------------------------------------------------------------------------


def test_group_returns_results_in_rank_order_with_tp_info(group2):
    """run() returns one result per rank in rank order; each rank's TPInfo and context agree."""
    results = group2.run(_rank_identity)
    assert results == [(0, 2, 0, 2), (1, 2, 1, 2)], f"(ctx rank, size, tp rank, size): {results}"
    pids = group2.run(_rank_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids, f"one process per rank: {pids}"


def test_collectives_give_expected_values_on_every_rank(group2):
    """all_reduce sums, all_gather concatenates in rank order, broadcast copies src, on 2 ranks."""
    _assert_collectives(group2.run(_rank_collectives), 2)


def test_state_persists_across_calls(group2):
    """ctx.state is per-process and survives between run() calls of one group."""
    first = group2.run(_rank_count_calls)
    second = group2.run(_rank_count_calls)
    grown = [s - f for f, s in zip(first, second, strict=True)]
    assert grown == [1, 1], f"call counts: {first} then {second}"


def test_four_ranks_collectives_and_identity():
    """A 4-rank group reports ranks 0..3 in order and its collectives span all 4 ranks."""
    with _make_group(4) as group:
        identity = group.run(_rank_identity)
        collectives = group.run(_rank_collectives)
        pids = group.run(_rank_pid)
    assert identity == [(r, 4, r, 4) for r in range(4)], f"identity: {identity}"
    _assert_collectives(collectives, 4)
    _assert_all_gone(pids, "after close()")


def test_raising_rank_reports_rank_and_traceback_and_tears_down():
    """A rank that raises gives RankError at once with its rank id and traceback, while the
    other rank is still busy; no worker survives."""
    group = _make_group(2)
    group.start()
    try:
        pids = group.run(_rank_pid)
        began = time.monotonic()
        with pytest.raises(RankError) as info:
            group.run(_rank_raise_on_one)
        elapsed = time.monotonic() - began
    finally:
        group.close(force=True)
    err = info.value
    assert err.rank == 1, f"failing rank: {err.rank}\n{err.detail}"
    assert elapsed < 10.0, f"RankError took {elapsed:.1f}s while rank 0 was busy"
    for needle in ("KeyError", "shard of layers.3.mlp missing", "_rank_raise_on_one"):
        assert needle in err.detail, f"{needle!r} missing from detail:\n{err.detail}"
    assert "rank 1" in str(err), f"message: {err}"
    _assert_all_gone(pids, "after RankError")


def test_hung_rank_times_out_with_its_stack():
    """A rank that hangs raises RankTimeout quickly, naming the hung function in its stack,
    and every worker is killed."""
    group = _make_group(2)
    group.start()
    try:
        pids = group.run(_rank_pid)
        began = time.monotonic()
        with pytest.raises(RankTimeout) as info:
            group.run(_rank_sleep_on, (1,), timeout=3.0)
        elapsed = time.monotonic() - began
    finally:
        group.close(force=True)
    stacks = info.value.stacks
    assert elapsed < 10.0, f"RankTimeout took {elapsed:.1f}s for a 3s timeout"
    assert list(stacks) == [1], f"hung ranks: {sorted(stacks)}"
    assert "_rank_sleep_on" in stacks[1], f"rank 1 stack:\n{stacks[1]}"
    assert "_rank_sleep_on" in info.value.describe(), f"describe:\n{info.value.describe()}"
    _assert_all_gone(pids, "after RankTimeout")


_ORPHAN_SCRIPT = """
import os, sys, threading, time
sys.path.insert(0, {test_dir!r})
import psutil
from test_launch import _make_group, _rank_pid, _rank_sleep_on
group = _make_group(2)
group.start()
pids = group.run(_rank_pid)
servers = {{psutil.Process(p).ppid() for p in pids}} - {{os.getpid()}}
print(" ".join(str(p) for p in pids + sorted(servers)), flush=True)
threading.Thread(target=group.run, args=(_rank_sleep_on, (0, 1)), daemon=True).start()
time.sleep(1.0)
os._exit(1)
"""


def test_workers_exit_when_parent_dies_without_closing(tmp_path):
    """Workers busy in a call (and their fork server) exit on their own when the parent
    process dies without closing its group: they watch the parent pid, not just their pipe."""
    script = textwrap.dedent(_ORPHAN_SCRIPT.format(test_dir=str(Path(__file__).parent)))
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        # The orphans inherit stdout: read one line after the exit, never wait for EOF.
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=err, text=True,
                                env=dict(os.environ, TMPDIR=str(tmp_path)))
    with proc.stdout:
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        pids = [int(p) for p in proc.stdout.readline().split()]
    assert proc.returncode == 1 and len(pids) >= 2, \
        f"rc={proc.returncode} pids={pids}\n{err_path.read_text()}"
    try:
        _assert_all_gone(pids, "after the parent died")
    finally:
        _kill_leftovers(pids)
    # The ranks remove it as they go; test_lifecycle holds all of TMPDIR to that.
    left = [p.name for p in tmp_path.glob("freetoken-ranks-*")]
    assert not left, f"the group's temp directory survived its parent: {left}"


_KILLED_SCRIPT = """
import sys
sys.path.insert(0, {test_dir!r})
from test_launch import _make_group, _rank_tensor
from freetoken.distributed.launch import close_all_groups
group = _make_group(2)
group.start()
group.run(_rank_tensor)
close_all_groups()
"""


def _rank_tensor(ctx) -> torch.Tensor:
    return torch.arange(4.0) + ctx.rank


def test_killed_ranks_leave_nothing_in_tmpdir(tmp_path):
    """A rank that sent a tensor has a multiprocessing socket directory; killed (Ctrl-C,
    SIGTERM) it cannot remove it, so it lives in the group's directory that the parent
    removes: nothing of the ranks is left in TMPDIR."""
    script = textwrap.dedent(_KILLED_SCRIPT.format(test_dir=str(Path(__file__).parent)))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    time.sleep(0.5)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not left, f"left in TMPDIR after the ranks were killed: {left}"


def test_a_rank_that_cannot_start_takes_the_others_and_the_directory_with_it(monkeypatch):
    """Starting rank 1 fails (no fork server, no memory): the error propagates, rank 0 is
    stopped and the group's temp directory removed - nothing is left behind."""
    spawned: list[int] = []
    dirs: list[Path] = []
    real = RankGroup._spawn

    def flaky(self, ctx, rank):
        if rank == 1:
            raise OSError("cannot fork")
        real(self, ctx, rank)
        spawned.append(self._procs[-1].pid)
        dirs.append(self._tmp)

    monkeypatch.setattr(RankGroup, "_spawn", flaky)
    group = _make_group(2)
    with pytest.raises(OSError, match="cannot fork"):
        group.start()
    assert spawned and not group.running, (spawned, group.running)
    _assert_all_gone(spawned, "after a failed start")
    assert not dirs[0].exists(), f"the group's directory survived: {dirs[0]}"


# --- placement -------------------------------------------------------------------------------


def _make_cuda(monkeypatch, available: bool, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cpu_placement_is_gloo():
    """device=cpu always places ranks on CPU with gloo, at any TP size."""
    for tp in (1, 2, 8):
        placement = choose_placement("cpu", tp)
        assert placement.name == "cpu-gloo", f"tp={tp}: {placement}"
        assert placement.backend == "gloo" and not placement.is_cuda, f"tp={tp}: {placement}"
        assert placement.device_for(tp - 1) == torch.device("cpu"), f"tp={tp} device"


@pytest.mark.parametrize("tp", [0, -1])
def test_non_positive_tp_is_rejected(tp):
    """tp_size below 1 is a PlacementError naming the value."""
    with pytest.raises(PlacementError, match=f"tp_size must be >= 1, got {tp}"):
        choose_placement("cpu", tp)


def test_cuda_without_gpu_is_rejected_and_auto_falls_back(monkeypatch):
    """device=cuda without a visible GPU is a PlacementError; device=auto falls back to CPU."""
    _make_cuda(monkeypatch, available=False, count=0)
    with pytest.raises(PlacementError, match="no CUDA device"):
        choose_placement("cuda", 1)
    assert choose_placement("auto", 2).name == "cpu-gloo", "auto without CUDA"
    with pytest.raises(PlacementError, match="unknown device 'tpu'"):
        choose_placement("tpu", 1)


def test_cuda_placement_policy(monkeypatch):
    """Enough GPUs gives NCCL; too few gives shared gloo with --oversubscribe and otherwise an
    error suggesting --oversubscribe."""
    _make_cuda(monkeypatch, available=True, count=2)
    nccl = choose_placement("cuda", 2)
    assert (nccl.name, nccl.backend, nccl.num_gpus) == ("cuda-nccl", "nccl", 2), f"{nccl}"
    assert choose_placement("auto", 1).name == "cuda-nccl", "auto with CUDA"
    shared = choose_placement("cuda", 4, oversubscribe=True)
    assert (shared.name, shared.backend, shared.num_gpus) == ("cuda-shared-gloo", "gloo", 2), \
        f"{shared}"
    with pytest.raises(PlacementError, match="--oversubscribe") as info:
        choose_placement("cuda", 4)
    assert "tp_size=4" in str(info.value) and "2 visible" in str(info.value), f"{info.value}"


def test_device_for_round_robins_over_gpus():
    """Rank r computes on cuda:(r mod num_gpus)."""
    placement = Placement("cuda-shared-gloo", 3)
    got = [placement.device_for(r) for r in range(7)]
    assert got == [torch.device("cuda", r % 3) for r in range(7)], f"devices: {got}"


# --- TP info ---------------------------------------------------------------------------------


def test_divide_names_the_dimension():
    """divide returns the quotient, or a ValueError naming the dimension and both sizes."""
    assert divide(8, 4, "num_attention_heads") == 2, "8 / 4"
    with pytest.raises(ValueError) as info:
        divide(2, 3, "num_key_value_heads")
    assert str(info.value) == "num_key_value_heads=2 cannot be split across tp_size=3", \
        f"message: {info.value}"


def test_tpinfo_is_frozen_and_validated():
    """TPInfo rejects out-of-range rank or size and cannot be mutated."""
    info = TPInfo(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 0
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="invalid TP rank"):
            TPInfo(rank, size)
    assert TPInfo().size == 1 and TPInfo().is_first, "default is TP=1, rank 0"


def test_acting_as_restores_the_identity_it_found():
    """`acting_as` gives the block its TP identity and puts back exactly what was there:
    unset stays unset (a later set_tp_info of another size still works), a set identity
    comes back, also when the block raises."""
    reset_tp_info()
    with acting_as(TPInfo(3, 8)):
        assert get_tp_info() == TPInfo(3, 8)
    assert get_tp_info() == TPInfo(), "unset identity reads as TP=1"
    set_tp_info(TPInfo(0, 2))
    try:
        with pytest.raises(RuntimeError, match="inside"), acting_as(TPInfo(1, 4)):
            assert get_tp_info() == TPInfo(1, 4)
            raise RuntimeError("inside")
        assert get_tp_info() == TPInfo(0, 2), "the set identity comes back"
    finally:
        reset_tp_info()
