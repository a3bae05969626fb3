"""The engine loop: runs one LLMEngine on its own thread and is the only way in from others.

Workers handle RPCs on many threads; the engine is single-threaded by design. Every call
goes through the command queue and runs on the engine thread between steps, and step
outputs are routed to one queue per request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from engine.block_pool import CacheEvent
from engine.errors import EngineDiedError, EngineStoppedError
from engine.llm_engine import EngineStats, LLMEngine
from engine.request import StepOutput, sample_ids

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestStream:
    """Step outputs of one request's samples (sample_ids), in order per sample, ending once
    every sample has its finished one."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._num_open = len(request_ids)
        self._outputs: queue.SimpleQueue[StepOutput | BaseException] = queue.SimpleQueue()

    def put(self, item: StepOutput | BaseException) -> None:
        self._outputs.put(item)

    def get(self, timeout_s: float | None = None) -> StepOutput:
        item = self._outputs.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def is_done(self) -> bool:
        """Every sample's finished output has been read."""
        return self._num_open == 0

    def __iter__(self) -> Iterator[StepOutput]:
        while self._num_open > 0:
            output = self.get()
            self._num_open -= output.finished
            yield output


class EngineLoop:
    """Commands are (fn, future) pairs: a future is set by the engine thread, or failed when the
    loop ends, so no caller of call() ever waits on a loop that is gone.

    An exception that escapes a step or a posted command kills the loop (its state is no longer
    known to be sound): every open stream and queued call fails with EngineDiedError, and
    on_death tells the worker, which must stop serving and exit.
    """

    def __init__(
        self, engine: LLMEngine, on_step: Callable[[float, int], None] | None = None,
        on_death: Callable[[EngineDiedError], None] | None = None,
        on_cache_events: Callable[[list[CacheEvent], list[CacheEvent]], None] | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.on_step = on_step  # (step seconds, batch size) for the worker's metrics
        self.on_death = on_death
        # The prefix-cache changes of each loop turn (commands and a step), in one batch: the
        # pool's and the host tier's; it must not block (the worker hands them to its
        # publisher thread).
        self.on_cache_events = on_cache_events
        engine.pool.record_events = on_cache_events is not None
        if engine.tier is not None:
            engine.tier.record_events = on_cache_events is not None
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], Future | None]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, RequestStream] = {}
        self._stopped = threading.Event()
        self._ended: EngineStoppedError | None = None  # set once, when the loop is over
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # A snapshot taken on the engine thread: other threads (heartbeat, metrics) read this,
        # never the scheduler's queues while they change.
        self.stats: EngineStats = engine.stats()

    @property
    def error(self) -> EngineStoppedError | None:
        """Why the loop is over (EngineDiedError when it died), or None while it runs."""
        return self._ended

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put((lambda: None, None))  # wake the loop
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def call(self, fn: Callable[[], T]) -> T:
        """Runs fn on the engine thread between steps and returns its result (or raises)."""
        future: Future[T] = Future()
        self._put(fn, future)
        return future.result()

    def post(self, fn: Callable[[], None]) -> None:
        """Runs fn on the engine thread without waiting (aborts, releases)."""
        self._put(fn, None)

    def _put(self, fn: Callable[[], object], future: Future | None) -> None:
        if self._ended is not None:
            raise self._ended
        self._commands.put((fn, future))
        # The loop drains the queue only after setting _ended: if it is still unset here, the
        # drain is yet to come and will see this command.
        if self._ended is not None:
            raise self._ended

    def open_stream(self, request_id: str, n: int = 1) -> RequestStream:
        """Call on the engine thread (inside call()) when a request enters the engine: one
        stream for its n samples (those the engine forks later included)."""
        stream = RequestStream(sample_ids(request_id, n))
        for sample_id in stream.request_ids:
            self._streams[sample_id] = stream
        return stream

    def abort(self, request_id: str, n: int = 1) -> None:
        """Ends the request and its samples (unforked ones are never forked); a reader of
        their stream gets a final output with reason "abort" for each unfinished sample."""

        def run() -> None:
            for index, sample_id in enumerate(sample_ids(request_id, n)):
                self.engine.abort_request(sample_id)
                stream = self._streams.pop(sample_id, None)
                if stream is not None:
                    stream.put(StepOutput(sample_id, [], "", 0, True, "abort", index=index))

        with contextlib.suppress(EngineStoppedError):  # nothing is left to abort
            self.post(run)

    def _run(self) -> None:
        try:
            was_busy = False
            while not self._stopped.is_set():
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                    was_busy = True
                else:
                    if was_busy:  # cheap, and a corrupt cache must never serve another request
                        self.engine.kv.check_integrity()
                        was_busy = False
                    self.stats = self.engine.stats()
                self._hand_over_cache_events()
        except BaseException as e:  # anything escaping here leaves the engine unsound
            log.exception("engine thread died")
            died = EngineDiedError(f"the engine thread died: {type(e).__name__}: {e}")
            self._end(died)
            if self.on_death is not None:
                self.on_death(died)
        else:
            self._end(EngineStoppedError("engine loop is stopped"))

    def _run_commands(self) -> None:
        busy = self.engine.has_unfinished_requests()
        try:
            item = self._commands.get(block=not busy, timeout=None if busy else 0.5)
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future is None:
                fn()  # a posted command that raises kills the loop
            else:
                try:
                    future.set_result(fn())
                except Exception as e:  # handed to the caller's thread
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                item = None

    def _hand_over_cache_events(self) -> None:
        if self.on_cache_events is None:
            return
        events = self.engine.pool.take_cache_events()
        tier = self.engine.tier
        host_events = tier.take_events() if tier is not None else []
        if events or host_events:
            self.on_cache_events(events, host_events)

    def _end(self, error: EngineStoppedError) -> None:
        self._ended = error
        for stream in set(self._streams.values()):
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.set_exception(error)

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        self.stats = self.engine.stats()
        if self.on_step is not None:
            self.on_step(time.perf_counter() - start, len(outputs))
        for output in outputs:
            self.route(output)

    def route(self, output: StepOutput) -> None:
        """Engine thread: hands an output to its request's stream (a step's, or one a command
        produced, such as a committed remote prefill's first token)."""
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
