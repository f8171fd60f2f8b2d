"""One `LLM` shared by many threads: every caller gets exactly the outputs its requests give
when run alone (greedy and seeded sampling, different lengths, several prompts per call), at
TP 1 in process and at TP 2 in a rank group; closing while a call is in flight fails that call
with LLMClosed, and so does every call afterwards; a refused request leaves the LLM
serving."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil
import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM, LLMClosed, SamplingParams

_THREADS = 8
_CASES = {1: "tiny-llama", 2: "tiny-qwen3-moe"}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def shared_llm(request):
    tp = request.param
    with LLM(GOLDEN / _CASES[tp], tp=tp, device="cpu", dtype="float32", progress=False,
             max_model_len=512, num_kv_blocks=24) as llm:
        yield llm


def _make_call(k: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Thread k's call: a greedy prompt and a seeded (or, for odd k, unseeded) sampled one,
    lengths and token counts varying with k."""
    prompts = [[1 + k, 7, 3 + 2 * k][: 1 + k % 3], [5 + k] * (k + 2)]
    sampled = SamplingParams(max_tokens=2 + k % 3, temperature=0.9, top_k=20,
                             seed=None if k % 2 else 100 + k, ignore_eos=True)
    return prompts, [SamplingParams(max_tokens=3 + k % 4, ignore_eos=True), sampled]


def _run_threads(llm: LLM, calls: list) -> list:
    """Every call from its own thread, all released at once; each thread's outputs (token
    ids per prompt) or the exception it raised."""
    outcomes: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def work(k: int) -> None:
        start.wait()
        try:
            outcomes[k] = [r.token_ids for r in llm.generate(*calls[k])]
        except Exception as e:  # recorded: the assertion names the thread that raised
            outcomes[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outcomes


def _assert_own_outputs(alone: list, together: list, label: str) -> None:
    for k, (want, got) in enumerate(zip(alone, together)):
        assert not isinstance(got, BaseException), f"{label} thread {k} raised {got!r}"
        assert got == want, f"{label} thread {k}: got {got}, alone it gives {want}"


def test_concurrent_callers_get_their_own_outputs(shared_llm):
    """8 threads calling generate at once each get the outputs of their own requests, equal
    to the same call made alone."""
    calls = [_make_call(k) for k in range(_THREADS)]
    alone = [[r.token_ids for r in shared_llm.generate(*call)] for call in calls]
    label = f"TP {shared_llm.tp}"
    for _ in range(2):  # the second round starts with the driver thread already running
        _assert_own_outputs(alone, _run_threads(shared_llm, calls), label)


def test_bad_values_refused_in_the_parent_and_the_llm_keeps_serving(shared_llm):
    """Values no rank can take (a seed past 2**63, a request larger than the whole cache) are
    refused in the parent naming the value; the next request is served."""
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        shared_llm.generate([[1, 2]], SamplingParams(temperature=1.0, seed=2**64))
    with pytest.raises(ValueError, match="need 26 cache blocks, the cache has 24"):
        shared_llm.generate([[1] * 10], SamplingParams(max_tokens=400))
    result = shared_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(result[0].token_ids) == 2, f"TP {shared_llm.tp}: {result}"


def test_tensor_prompts(shared_llm):
    """A 1-D integer tensor is one prompt of token ids, a 2-D tensor one prompt per row; a
    float tensor and a 3-D tensor are refused naming the prompt and what is wrong."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    want = [r.token_ids for r in shared_llm.generate([[4, 5, 6], [7, 8, 9]], params)]
    one = shared_llm.generate(torch.tensor([4, 5, 6]), params)
    rows = shared_llm.generate(torch.tensor([[4, 5, 6], [7, 8, 9]]), params)
    assert [r.token_ids for r in one] == want[:1], f"1-D tensor: {one}"
    assert [r.token_ids for r in rows] == want, f"2-D tensor: {rows}"
    with pytest.raises(ValueError, match="prompt 0: .* integer dtype, got torch.float32"):
        shared_llm.generate(torch.tensor([1.0, 2.0]), params)
    with pytest.raises(ValueError, match=r"1-D .* or 2-D .*, got shape \[1, 1, 2\]"):
        shared_llm.generate(torch.ones(1, 1, 2, dtype=torch.long), params)


def _wait_in_flight(llm: LLM, label: str) -> None:
    deadline = time.monotonic() + 60
    while not llm._driver._live():
        assert time.monotonic() < deadline, f"{label}: the call never reached the engine"
        time.sleep(0.01)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("forced", [False, True], ids=["shutdown", "exception"])
def test_closing_fails_calls_in_flight_with_llm_closed(tp, forced):
    """Leaving the with block (normally, or by an exception: the ranks are killed at once)
    while another thread generates fails that call with LLMClosed ("in flight"), not a rank
    death; calls afterwards raise LLMClosed; no rank survives; the rank group is never
    closed while the driver thread is inside its `run` (both would close its pipes)."""
    label = f"TP {tp} {'exception' if forced else 'shutdown'}"
    outcome: list = []
    with pytest.raises(KeyError) if forced else contextlib.nullcontext():
        with LLM(GOLDEN / "tiny-llama", tp=tp, device="cpu", progress=False,
                 max_model_len=512) as llm:
            ranks = [p.pid for p in llm._group._procs] if llm._group else []
            watch = _GroupWatch(llm._group) if llm._group else None
            if watch:
                llm._group = watch
            worker = threading.Thread(target=lambda: outcome.append(_generate_or_error(llm)))
            worker.start()
            _wait_in_flight(llm, label)
            if forced:
                raise KeyError("the body failed")
    worker.join(60)
    assert outcome and isinstance(outcome[0], LLMClosed), f"{label}: the caller got {outcome}"
    assert "in flight" in str(outcome[0]), f"{label}: {outcome[0]}"
    with pytest.raises(LLMClosed, match="LLM closed"):
        llm.generate([[1, 2]])
    assert not (watch and watch.overlaps), f"{label}: the group was closed inside a run"
    alive = [pid for pid in ranks if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"{label}: rank processes {alive} outlived the LLM"


class _GroupWatch:
    """A RankGroup that records every `close` begun while a `run` is inside it."""

    def __init__(self, group):
        self.group = group
        self.inside = 0
        self.overlaps: list[bool] = []

    def run(self, *args, **kwargs):
        self.inside += 1
        try:
            return self.group.run(*args, **kwargs)
        finally:
            self.inside -= 1

    def close(self, force: bool = False) -> None:
        if self.inside:
            self.overlaps.append(force)
        self.group.close(force=force)

    def __getattr__(self, name):
        return getattr(self.group, name)


def _generate_or_error(llm: LLM):
    try:
        return llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=500, ignore_eos=True))
    except Exception as e:  # the test asserts which exception the caller got
        return e
