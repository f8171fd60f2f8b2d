"""The driver behind `LLM.generate`, on a stand-in engine (no model): requests of concurrent
calls share the engine's steps and each call gets its own results in its order; `exclusive`
waits for the calls in flight and holds new ones back; an engine failure reaches exactly the
calls in flight and the engine is reset for the next; close fails the calls in flight and
every later one with LLMClosed."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken.engine.driver import Driver, LLMClosed
from freetoken.engine.sequence import GenerationResult, Request, SamplingParams


class _FakeEngine:
    """Finishes each request after `max_tokens` steps with the tokens `[seed] * max_tokens`;
    records the requests in flight at every step and raises when told to."""

    def __init__(self, step_s: float = 0.005):
        self.live: dict[int, list] = {}
        self.batches: list[set[int]] = []
        self.step_s = step_s
        self.fail_next = False
        self.resets = 0

    def advance(self, new: list[Request]) -> list[tuple[int, GenerationResult]]:
        for r in new:
            self.live[r.request_id] = [r, 0]
        time.sleep(self.step_s)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine step failed")
        self.batches.append(set(self.live))
        done = []
        for request_id, entry in list(self.live.items()):
            entry[1] += 1
            request = entry[0]
            if entry[1] == request.params.max_tokens:
                del self.live[request_id]
                done.append((request_id, GenerationResult(request.prompt,
                                                           [request.seed] * entry[1], "length")))
        return done

    def reset(self) -> None:
        self.live.clear()
        self.resets += 1


def _make_requests(k: int, n: int = 2) -> list[Request]:
    return [Request(0, [k, j], SamplingParams(max_tokens=1 + (k + j) % 4), 10 * k + j)
            for j in range(n)]


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn(*args))
        except Exception as e:  # the test asserts on the exception the caller got
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _assert_results(k: int, results, label: str) -> None:
    want = [[10 * k + j] * (1 + (k + j) % 4) for j in range(2)]
    got = [r.token_ids for r in results] if isinstance(results, list) else results
    assert got == want, f"{label} call {k}: got {got}, want {want}"


def test_concurrent_calls_share_steps_and_get_their_own_results():
    """Eight calls at once: each gets its own results in its order, and some step ran the
    requests of more than one call together."""
    engine = _FakeEngine()
    driver = Driver(engine.advance, engine.reset)
    runs = [_in_thread(driver.submit, _make_requests(k)) for k in range(8)]
    for k, (thread, out) in enumerate(runs):
        thread.join(30)
        _assert_results(k, out[0], "concurrent")
    assert max(len(b) for b in engine.batches) > 2, f"no shared step: {engine.batches}"
    driver.close()


def test_exclusive_waits_for_calls_in_flight_and_holds_new_ones():
    """`exclusive` starts only when no request is in the engine, and a call submitted while
    it is held reaches the engine only after it ends."""
    engine = _FakeEngine(step_s=0.02)
    driver = Driver(engine.advance, engine.reset)
    first, first_out = _in_thread(driver.submit, _make_requests(3))
    while not engine.live:
        time.sleep(0.001)
    with driver.exclusive():
        assert not engine.live, f"exclusive began with {engine.live} in flight"
        second, second_out = _in_thread(driver.submit, _make_requests(5))
        time.sleep(0.1)
        assert not engine.live and not second_out, "a call reached the engine under exclusive"
    second.join(30)
    first.join(30)
    _assert_results(3, first_out[0], "before exclusive")
    _assert_results(5, second_out[0], "after exclusive")
    driver.close()


def test_engine_failure_reaches_the_calls_in_flight_then_the_engine_serves():
    """A step that raises fails the call in flight with that error and resets the engine;
    the next call is served."""
    engine = _FakeEngine()
    driver = Driver(engine.advance, engine.reset)
    engine.fail_next = True
    with pytest.raises(RuntimeError, match="engine step failed"):
        driver.submit(_make_requests(1))
    assert engine.resets == 1, f"engine reset {engine.resets} times after the failure"
    _assert_results(2, driver.submit(_make_requests(2)), "after the failure")
    driver.close()


def test_close_fails_the_call_in_flight_and_later_calls():
    """close() settles the call in flight with LLMClosed naming what was unfinished, and
    refuses calls and exclusive use afterwards."""
    engine = _FakeEngine(step_s=0.05)
    driver = Driver(engine.advance, engine.reset)
    running, running_out = _in_thread(driver.submit, [Request(0, [1], SamplingParams(
        max_tokens=1000), 0)])
    while not engine.live:
        time.sleep(0.001)
    driver.close()
    running.join(30)
    assert isinstance(running_out[0], LLMClosed), running_out
    assert "1 of its 1 requests unfinished" in str(running_out[0]), running_out[0]
    with pytest.raises(LLMClosed, match="LLM closed"):
        driver.submit(_make_requests(0))
    with pytest.raises(LLMClosed, match="LLM closed"), driver.exclusive():
        pass
