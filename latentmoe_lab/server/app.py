"""The FastAPI app: OpenAI-compatible routes over an EngineWorker (docs/design.md §10).

    POST /v1/completions, /v1/chat/completions   JSON, or SSE with "stream": true
    GET  /v1/models, /health, /metrics            (/health and /metrics need no API key: probes, scrapers)

The handlers only parse, enqueue and stream (protocol.py -> samples.py -> answer.py); the engine runs on
its own thread. A client that goes away aborts its samples (a streaming one is cancelled by Starlette; a
waiting non-streaming one is polled), which frees their blocks and slots. A request body must arrive
within server.body_timeout_s (408 otherwise, and the connection is closed), and at most
server.max_body_bytes. Every JSON body is written ASCII-escaped, so that no text a client sent (a lone
surrogate in a field name) can fail the encoding of an answer.
"""
from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from latentmoe_lab.server.answer import collect, stream
from latentmoe_lab.server.choices import TokenText
from latentmoe_lab.server.errors import APIError, bad_request
from latentmoe_lab.server.protocol import parse_request
from latentmoe_lab.server.responses import Shape
from latentmoe_lab.server.samples import Samples
from latentmoe_lab.server.worker import EngineWorker


class AsciiJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def build_app(worker: EngineWorker, api_key: str | None = None) -> FastAPI:
    config, settings, metrics = worker.config, worker.settings, worker.metrics
    served_model = config.model.name
    TokenText.of(worker.model)  # the checkpoint's tokenizer and chat template, read before the first request
    app = FastAPI(title="LatentMoE Lab", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=AsciiJSONResponse)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        metrics.errors.labels(kind=error.code or error.type).inc()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        # a body left unread (408) cannot be followed by another request on this connection
        headers = {"Connection": "close"} if error.status == 408 else headers
        return AsciiJSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        body = APIError(error.status_code, str(error.detail), None, "not_found" if error.status_code == 404 else None)
        return AsciiJSONResponse(body.body(), status_code=error.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_left(_request: Request, _error: ClientDisconnect):
        metrics.errors.labels(kind="client_disconnected").inc()
        return Response(status_code=499)  # nobody reads it: the client left while sending its body

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, error: Exception):
        metrics.errors.labels(kind="internal").inc()
        body = APIError(500, f"internal error: {type(error).__name__}: {error}", None, "internal", "server_error")
        return AsciiJSONResponse(body.body(), status_code=500)

    def check_key(request: Request) -> None:
        """'Authorization: Bearer KEY', the scheme in any case (RFC 7235); 401 names the scheme it wants."""
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key")

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise bad_request(f"request body: {declared[:20]} bytes, over the limit of {settings.max_body_bytes}",
                              None, "body_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(settings.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > settings.max_body_bytes:
                        raise bad_request(f"request body: over the limit of {settings.max_body_bytes} bytes", None,
                                          "body_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"request body: not received within server.body_timeout_s "
                                f"({settings.body_timeout_s:g} s)", None, "body_timeout") from None
        try:
            return json.loads(b"".join(chunks))
        # ValueError: also JSON integers past Python's 4300-digit conversion limit; RecursionError: [[[[...
        except (ValueError, RecursionError) as error:
            raise bad_request(f"request body: malformed JSON ({str(error)[:200]})", None, "invalid_json") from None

    async def completion(request: Request, kind: str):
        check_key(request)
        texts = TokenText.of(worker.model)  # the engine's own tokenizer object
        parsed = parse_request(await read_json(request), kind, served_model, worker.model.config.vocab_size,
                               config.model.max_model_len, settings.default_max_tokens, texts.encode,
                               texts.chat_template)
        samples = await Samples(worker, parsed).submit()
        shape = Shape(parsed, samples.keys[0], served_model, texts)
        if parsed.stream:
            return StreamingResponse(stream(samples, shape, request), media_type="text/event-stream")
        return await collect(samples, shape, request)

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
        problem = worker.health_problem()
        body = {"status": "ok" if problem is None else "unavailable", "restarts": worker.restarts,
                **({} if problem is None else {"reason": problem}), **worker.last_stats}
        return AsciiJSONResponse(body, status_code=200 if problem is None else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
