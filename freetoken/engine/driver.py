"""One engine shared by any number of calling threads: each call's requests go into a
submission queue, one driver thread feeds them into the running continuous batch and steps
the engine, and each finished request's result is routed back to the call that submitted it.

The engine (a rank group at TP>1: one `run` at a time through its pipes) is only ever touched
by the driver thread, or by one `exclusive()` holder while the driver is idle, so two
callers' messages never interleave."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from freetoken.engine.sequence import GenerationResult, Request

Advance = Callable[[list[Request]], list[tuple[int, GenerationResult]]]
"""Adds new requests to the engine, runs some steps, returns (id, result) of those finished."""


class LLMClosed(RuntimeError):
    """The LLM was shut down before this call, or while this call was in flight."""


class _Call:
    """One `submit` waiting for its requests' results."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.results: dict[int, GenerationResult] = {}
        self.error: BaseException | None = None
        self.done = threading.Event()

    def settle(self, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class Driver:
    """The submission queue and the thread that steps the engine through `advance`.
    `reset`, called after `advance` raised, leaves the engine with no request in flight."""

    def __init__(self, advance: Advance, reset: Callable[[], None]):
        self._advance = advance
        self._reset = reset
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._queued: list[Request] = []
        self._calls: dict[int, _Call] = {}
        self._stepping = False
        self._exclusive = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, requests: list[Request]) -> list[GenerationResult]:
        """Results of `requests` (ids are reassigned here), in their order, once the engine
        finished all of them; LLMClosed when the driver closes first, or the engine's
        exception when a step fails while they are in flight."""
        with self._cond:
            self._check_open()
            call = _Call([next(self._ids) for _ in requests])
            for request_id, request in zip(call.ids, requests):
                self._calls[request_id] = call
                self._queued.append(Request(request_id, request.prompt, request.params,
                                            request.seed))
            self._start_thread()
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return [call.results[i] for i in call.ids]

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine alone: waits until no request is in flight (new ones stay queued
        until the block ends)."""
        with self._cond:
            self._check_open()
            self._exclusive += 1
            try:
                self._cond.wait_for(lambda: self._closed or not (self._stepping or self._live()))
                self._check_open()
            except BaseException:
                self._release_exclusive()
                raise
        try:
            yield
        finally:
            with self._cond:
                self._release_exclusive()

    def close(self, wait: bool = True) -> None:
        """Fail every call in flight with LLMClosed and stop the driver thread; `wait` joins
        it (it returns once the engine steps it is running, if any, return)."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._fail(list(self._calls), lambda call: LLMClosed(
                    f"LLM closed while this call was in flight: "
                    f"{len(call.ids) - len(call.results)} of its {len(call.ids)} requests "
                    f"unfinished"))
                self._queued = []
                self._cond.notify_all()
        if wait:
            self.join()

    def join(self) -> None:
        """Wait for the driver thread to end (after `close`)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _check_open(self) -> None:
        if self._closed:
            raise LLMClosed("LLM closed: shutdown() was called or its with block ended; "
                            "create a new LLM")

    def _release_exclusive(self) -> None:
        self._exclusive -= 1
        self._cond.notify_all()

    def _live(self) -> bool:
        """Requests handed to the engine and not finished."""
        return len(self._calls) > len(self._queued)

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="freetoken-driver",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (
                    not self._exclusive and bool(self._queued) or self._live()))
                if self._closed:
                    return
                new, self._queued = self._queued, []
                self._stepping = True
            try:
                finished = self._advance(new)
            except BaseException as error:  # the callers waiting on the engine get it
                self._engine_failed(error)
                continue
            with self._cond:
                self._stepping = False
                self._route(finished)
                self._cond.notify_all()

    def _engine_failed(self, error: BaseException) -> None:
        with self._cond:
            self._stepping = False
            queued = {r.request_id for r in self._queued}
            live = [i for i in self._calls if i not in queued]
            self._fail(live, lambda call: error)
            self._cond.notify_all()
        self._reset()

    def _route(self, finished: list[tuple[int, GenerationResult]]) -> None:
        for request_id, result in finished:
            call = self._calls.pop(request_id, None)
            if call is None:
                continue  # its call already failed (closed, or an earlier step raised)
            call.results[request_id] = result
            if len(call.results) == len(call.ids):
                call.settle()

    def _fail(self, request_ids: list[int], error: Callable[[_Call], BaseException]) -> None:
        """Settle the calls of `request_ids` with `error(call)`; drop all their requests."""
        calls = {id(c): c for c in (self._calls[i] for i in request_ids if i in self._calls)}
        for call in calls.values():
            call.settle(error(call))
            for request_id in call.ids:
                self._calls.pop(request_id, None)
        self._queued = [r for r in self._queued if r.request_id in self._calls]
