"""The FastAPI app: OpenAI-compatible routes over an EngineWorker (docs/design.md §10).

    POST /v1/completions, /v1/chat/completions   JSON, or SSE with "stream": true
    GET  /v1/models, /health, /metrics            (/health and /metrics need no API key: probes, scrapers)

The handlers only parse, enqueue and stream: each request gets an asyncio.Queue that the engine thread
feeds through loop.call_soon_threadsafe. A client that goes away aborts its request (a streaming one is
cancelled by Starlette; a waiting non-streaming one is polled), which frees its blocks and slot.
Each choice carries "token_ids", the generated ids (an extension; OpenAI clients keep unknown fields).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from latentmoe_lab.server.detokenizer import IncrementalDetokenizer
from latentmoe_lab.server.errors import APIError, bad_request
from latentmoe_lab.server.protocol import ParsedRequest, parse_request
from latentmoe_lab.server.stops import StopMatcher
from latentmoe_lab.server.worker import EngineWorker, Event
from latentmoe_lab.serving import QueueFullError

DISCONNECT_POLL_S = 0.25


def build_app(worker: EngineWorker, api_key: str | None = None) -> FastAPI:
    config, settings, metrics = worker.config, worker.settings, worker.metrics
    served_model = config.model.name
    app = FastAPI(title="LatentMoE Lab", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        metrics.errors.labels(kind=error.code or error.type).inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        body = APIError(error.status_code, str(error.detail), None, "not_found" if error.status_code == 404 else None)
        return JSONResponse(body.body(), status_code=error.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_left(_request: Request, _error: ClientDisconnect):
        metrics.errors.labels(kind="client_disconnected").inc()
        return Response(status_code=499)  # nobody reads it: the client left while sending its body

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, error: Exception):
        metrics.errors.labels(kind="internal").inc()
        body = APIError(500, f"internal error: {type(error).__name__}: {error}", None, "internal", "server_error")
        return JSONResponse(body.body(), status_code=500)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key")

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise bad_request(f"request body: {declared} bytes, over the limit of {settings.max_body_bytes}",
                              None, "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise bad_request(f"request body: over the limit of {settings.max_body_bytes} bytes", None,
                                  "body_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:  # RecursionError: [[[[...
            raise bad_request(f"request body: malformed JSON ({error})", None, "invalid_json") from None

    async def accept(parsed: ParsedRequest, queue: asyncio.Queue) -> int:
        mailbox = _Mailbox.of(asyncio.get_running_loop())
        future = worker.submit(parsed.prompt_ids, parsed.params, lambda event: mailbox.post(queue, event))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: f.exception() is None and worker.abort(f.result()))
            raise
        except QueueFullError as error:
            raise APIError(429, str(error), None, "queue_full", "rate_limit_error") from None
        except (ValueError, TypeError) as error:
            raise bad_request(str(error), str(error).split(":")[0]) from None
        except RuntimeError as error:
            raise APIError(503, str(error), None, "engine_unavailable", "server_error") from None

    async def events(request: Request, key: int, queue: asyncio.Queue, poll: bool) -> AsyncIterator[Event]:
        """The request's events; aborts it on a disconnect (poll=True) or past server.request_timeout_s."""
        deadline = time.monotonic() + settings.request_timeout_s
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        while True:
            now = time.monotonic()
            if poll and now >= next_poll:  # by the clock: tokens may arrive faster than the poll interval
                next_poll = now + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    worker.abort(key)
                    metrics.errors.labels(kind="client_disconnected").inc()
                    return
            if now > deadline:
                worker.abort(key)
                metrics.errors.labels(kind="request_timeout").inc()
                yield Event([], True, "error", f"request_timeout: unfinished after {settings.request_timeout_s} s")
                return
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):  # a timer, not a task per event (wait_for)
                    event = await queue.get()
            except TimeoutError:
                continue
            yield event
            if event.finished:
                return

    async def completion(request: Request, kind: str):
        check_key(request)
        parsed = parse_request(await read_json(request), kind, served_model, worker.model.config.vocab_size,
                               config.model.max_model_len)
        queue: asyncio.Queue = asyncio.Queue()
        key = await accept(parsed, queue)
        shape = _Shape(kind, key, served_model, len(parsed.prompt_ids))
        if parsed.stream:
            return StreamingResponse(_sse(shape, parsed, events(request, key, queue, poll=False), worker),
                                     media_type="text/event-stream")
        text, ids, reason, error = [], [], None, None
        detokenizer, stops = IncrementalDetokenizer(), StopMatcher(parsed.stops)
        async for event in events(request, key, queue, poll=True):
            ids += event.token_ids
            text.append(stops.feed(detokenizer.feed(event.token_ids)))
            if stops.stopped:
                worker.abort(key, "stop")
                reason = "stop"
                break
            if event.finished:
                reason, error = event.finish_reason, event.error
                text.append(stops.feed(detokenizer.flush()) + stops.flush())
        if reason is None:
            return Response(status_code=499)  # the client left; nobody reads this
        if reason == "error":
            return JSONResponse(_engine_error(error).body(), status_code=500)
        return JSONResponse(shape.full("".join(text), ids, reason))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": 0,
                                            "owned_by": "latentmoe-lab", "max_model_len": config.model.max_model_len}]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if worker.alive() else "unavailable", "restarts": worker.restarts,
                **worker.last_stats}
        return JSONResponse(body, status_code=200 if worker.alive() else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


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

    def post(self, queue: asyncio.Queue, event: Event) -> None:
        with self.lock:
            self.pending.append((queue, event))
            if len(self.pending) > 1:
                return  # a drain is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _drain(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, event in pending:
            queue.put_nowait(event)


def _engine_error(error: str | None) -> APIError:
    return APIError(500, error or "the engine failed this request", None, (error or "error").split(":")[0],
                    "server_error")


class _Shape:
    """The OpenAI response and chunk objects of one request."""

    def __init__(self, kind: str, key: int, model: str, prompt_tokens: int):
        self.kind, self.key, self.model, self.prompt_tokens = kind, key, model, prompt_tokens
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{key}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, ids: list[int], reason: str) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(ids),
                 "total_tokens": self.prompt_tokens + len(ids)}
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": ids}
            return self._head("text_completion") | {"choices": [choice], "usage": usage}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "token_ids": ids}
        return self._head("chat.completion") | {"choices": [choice], "usage": usage}

    def chunk(self, text: str | None, ids: list[int], reason: str | None, first: bool) -> dict:
        if self.kind == "completion":
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason, "token_ids": ids}
            return self._head("text_completion") | {"choices": [choice]}
        delta = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "token_ids": ids}
        return self._head("chat.completion.chunk") | {"choices": [choice]}


async def _sse(shape: _Shape, parsed: ParsedRequest, stream: AsyncIterator[Event], worker: EngineWorker):
    """Server-sent events: a chunk per engine event, the finish reason last, then [DONE]."""
    detokenizer, stops = IncrementalDetokenizer(), StopMatcher(parsed.stops)
    first, finished = True, False
    try:
        async for event in stream:
            text = stops.feed(detokenizer.feed(event.token_ids))
            if stops.stopped:
                worker.abort(shape.key, "stop")
                finished = True
                yield _data(shape.chunk(text, event.token_ids, None, first))
                yield _data(shape.chunk(None, [], "stop", False))
                break
            if event.finished:
                finished = True
                if event.finish_reason == "error":
                    yield _data(_engine_error(event.error).body())
                    break
                text += stops.feed(detokenizer.flush()) + stops.flush()
                if text or event.token_ids:
                    yield _data(shape.chunk(text, event.token_ids, None, first))
                    first = False
                yield _data(shape.chunk(None, [], event.finish_reason, first))
                break
            if text or event.token_ids:
                yield _data(shape.chunk(text, event.token_ids, None, first))
                first = False
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away (Starlette cancelled us) or the stream was cut short
            worker.abort(shape.key)
            worker.metrics.errors.labels(kind="client_disconnected").inc()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
