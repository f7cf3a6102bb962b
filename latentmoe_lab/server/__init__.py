"""The inference service (docs/design.md §10): the serving engine behind an OpenAI-compatible HTTP API.

    settings.py     the service file: ServiceConfig (§6.1) + our `server:` section (retries, restarts, limits)
    loading.py      a ServiceConfig -> the model it serves (preset + seed, or a checkpoint directory)
    errors.py       APIError: an HTTP status + an OpenAI-style error body naming the field
    fields.py       one request field -> a checked value, or a 400 naming it
    protocol.py     request JSON -> checked prompt ids + SamplingParams + the OpenAI options; the chat template
    chat_template.py  a transformers checkpoint's own chat template, rendered through transformers
    detokenizer.py  generated ids -> text as they arrive, equal to one decode of them all (bytes, or the
                    checkpoint's own tokenizer)
    stops.py        stop strings over streamed text (incremental matching, the held-back tail)
    choices.py      one choice as its tokens arrive: text cut at stops, tokens with logprobs and offsets;
                    TokenText, the served model's tokenizer (encode, detokenizer, token strings)
    responses.py    the OpenAI response and chunk objects (choices, logprobs, usage)
    prom.py         Prometheus metrics on the service's own registry
    worker.py       EngineWorker: the engine's thread; retries, restarts, requests re-queued by recompute
    samples.py      one HTTP request's n / best_of engine requests and their events; disconnect = abort all
    answer.py       the samples -> one JSON body or server-sent events (echo, stops, best_of)
    app.py          the FastAPI app: routes, API key, body limit and timeout, /health
    soak.py         the soak run: mixed requests through the openai client, sampled, drift table, report
    cli.py          `latentmoe-lab serve` and `latentmoe-lab soak`

    from latentmoe_lab.server import build_app, EngineWorker, load_service_file, start_service

The names load on first use, so `latentmoe-lab --help` and the other commands do not import FastAPI.
"""
from importlib import import_module

_EXPORTS = {"build_app": "app", "EngineWorker": "worker", "ServerSettings": "settings",
            "load_service_file": "settings", "start_service": "threaded"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'latentmoe_lab.server' has no attribute {name!r}")
    return getattr(import_module(f"latentmoe_lab.server.{_EXPORTS[name]}"), name)
