"""The engine requests of one HTTP request (best_of samples per prompt) and their events (docs/design.md §10).

Each sample is one engine request; their events arrive on one asyncio.Queue as (sample index, RequestEvent),
fed from the engine thread through the loop's _Mailbox. A client that goes away, or a request past
server.request_timeout_s, aborts every sample still running, which frees its blocks and slot.
"""
from __future__ import annotations

import asyncio
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator

from latentmoe_lab.server.errors import APIError, bad_request
from latentmoe_lab.server.protocol import ParsedRequest
from latentmoe_lab.server.worker import EngineWorker
from latentmoe_lab.serving import QueueFullError
from latentmoe_lab.serving.client_request import RequestEvent

DISCONNECT_POLL_S = 0.25
_FIELD = re.compile(r"[a-z_][a-z0-9_.\[\]]*")


class Samples:
    def __init__(self, worker: EngineWorker, parsed: ParsedRequest):
        self.worker, self.parsed = worker, parsed
        self.queue: asyncio.Queue = asyncio.Queue()
        self.keys: list[int] = []
        self.running: set[int] = set()  # sample indices whose end has not arrived

    async def submit(self) -> "Samples":
        """Queue every sample; on a refusal abort the ones already queued and raise its APIError."""
        mailbox = _Mailbox.of(asyncio.get_running_loop())
        for index, (prompt, params) in enumerate(self.parsed.samples):
            future = self.worker.submit(self.parsed.prompts[prompt], params,
                                        lambda event, i=index: mailbox.post(self.queue, (i, event)))
            try:
                self.keys.append(await asyncio.wrap_future(future))
            except asyncio.CancelledError:
                future.add_done_callback(lambda f: f.exception() is None and self.worker.abort(f.result()))
                self.abort()
                raise
            except Exception as error:
                self.abort()
                raise _refusal(error) from None
            self.running.add(index)
        return self

    def abort(self, reason: str = "abort") -> None:
        for index in self.running:
            self.worker.abort(self.keys[index], reason)

    def stop(self, index: int) -> None:
        """Sample `index` reached a stop string: end it (its end event still arrives)."""
        self.worker.abort(self.keys[index], "stop")

    async def events(self, request, poll: bool) -> AsyncIterator[tuple[int, RequestEvent]]:
        """(index, event) until every sample ended; aborts all on a disconnect (poll=True) or a timeout."""
        settings, metrics = self.worker.settings, self.worker.metrics
        deadline = time.monotonic() + settings.request_timeout_s
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        while self.running:
            now = time.monotonic()
            if poll and now >= next_poll:  # by the clock: tokens may arrive faster than the poll interval
                next_poll = now + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    self.abort()
                    metrics.errors.labels(kind="client_disconnected").inc()
                    return
            if now > deadline:
                self.abort()
                metrics.errors.labels(kind="request_timeout").inc()
                index = min(self.running)
                self.running.clear()
                yield index, RequestEvent([], True, "error",
                                          f"request_timeout: unfinished after {settings.request_timeout_s} s")
                return
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):  # a timer, not a task per event (wait_for)
                    index, event = await self.queue.get()
            except TimeoutError:
                continue
            if event.finished:
                self.running.discard(index)
            yield index, event


def _refusal(error: Exception) -> APIError:
    if isinstance(error, QueueFullError):
        return APIError(429, str(error), None, "queue_full", "rate_limit_error")
    if isinstance(error, (ValueError, TypeError)):
        head = str(error).split(":")[0]
        return bad_request(str(error), head if _FIELD.fullmatch(head) else None)
    if isinstance(error, RuntimeError):
        return APIError(503, str(error), None, "engine_unavailable", "server_error")
    return APIError(500, f"internal error: {type(error).__name__}: {error}", None, "internal", "server_error")


class _Mailbox:
    """Events from the engine thread to the requests' queues on the event loop, one wake-up per batch.

    A step delivers an event to every request it served; one call_soon_threadsafe each would wake the
    loop (and take the GIL from the engine thread) once per request. Events that arrive before the
    loop drains the box ride along with the first one's wake-up.
    """

    _boxes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loop -> its box (used on the loop only)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.pending = loop, threading.Lock(), []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_Mailbox":
        box = cls._boxes.get(loop)
        if box is None:
            box = cls._boxes[loop] = cls(loop)
        return box

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.pending.append((queue, item))
            if len(self.pending) > 1:
                return  # a drain is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _drain(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, item in pending:
            queue.put_nowait(item)
