"""The engine loop: runs one LLMEngine on its own thread and is the only way in from others.

Workers handle RPCs on many threads; the engine is single-threaded by design. Every call
goes through the command queue and runs on the engine thread between steps, and step
outputs are routed to one queue per request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from engine.llm_engine import EngineStats, LLMEngine
from engine.request import StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineStoppedError(RuntimeError):
    pass


class RequestStream:
    """Step outputs of one request, in order, ending with the finished one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._outputs: queue.SimpleQueue[StepOutput | BaseException] = queue.SimpleQueue()

    def put(self, item: StepOutput | BaseException) -> None:
        self._outputs.put(item)

    def get(self, timeout_s: float | None = None) -> StepOutput:
        item = self._outputs.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[StepOutput]:
        while True:
            output = self.get()
            yield output
            if output.finished:
                return


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[float, int], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # (step seconds, batch size) for the worker's metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # A snapshot taken on the engine thread: other threads (heartbeat, metrics) read this,
        # never the scheduler's queues while they change.
        self.stats: EngineStats = engine.stats()

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)  # wake the loop
        self._thread.join(timeout=30)

    def call(self, fn: Callable[[], T]) -> T:
        """Runs fn on the engine thread between steps and returns its result (or raises)."""
        if self._stopped.is_set():
            raise EngineStoppedError("engine loop is stopped")
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller's thread
                future.set_exception(e)

        self._commands.put(run)
        return future.result()

    def post(self, fn: Callable[[], None]) -> None:
        """Runs fn on the engine thread without waiting (aborts, releases)."""
        self._commands.put(fn)

    def open_stream(self, request_id: str) -> RequestStream:
        """Call on the engine thread (inside call()) when a request enters the engine."""
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Ends the request; a reader of its stream gets a final output with reason "abort"."""

        def run() -> None:
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(StepOutput(request_id, [], "", 0, True, "abort"))

        self.post(run)

    def _run(self) -> None:
        while not self._stopped.is_set():
            busy = self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                command = None
            while command is not None:
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished_requests():
                self._step()  # refreshes the stats itself, before on_step reads them
            else:
                self.stats = self.engine.stats()
        for stream in self._streams.values():
            stream.put(EngineStoppedError("engine loop stopped"))

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug must not hang every client: fail what was running
            log.exception("engine step failed")
            for request_id, stream in list(self._streams.items()):
                stream.put(e)
                self.engine.abort_request(request_id)
            self._streams.clear()
            self.stats = self.engine.stats()
            return
        self.stats = self.engine.stats()
        if self.on_step is not None:
            self.on_step(time.perf_counter() - start, len(outputs))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]
