"""A request's samples -> its answer: one JSON body, or server-sent events (docs/design.md §10).

Per sample a ChoiceText turns ids into text, cut at the stop strings; a sample that reaches a stop is
ended at once, and the tokens the engine made after its stop token (before the abort reached it) count
nowhere, in usage neither, so usage and every per-token list are the same whatever the step timing.
With echo (completions) a choice's text and tokens begin with its prompt's (their logprobs come with the
sample's first event). Samples are numbered prompt-major (prompt p's sample j is
p * best_of + j). best_of > n: every sample runs to its end, and each prompt's n with the highest
cumulative logprob (over their kept tokens: at a stop, to its token) are returned; choice p * n + k is
prompt p's k-th.
"""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse, Response

from latentmoe_lab.server.choices import ChoiceText, Released, prompt_text
from latentmoe_lab.server.errors import APIError
from latentmoe_lab.server.responses import Shape
from latentmoe_lab.server.samples import Samples


def engine_error(error: str | None) -> APIError:
    return APIError(500, error or "the engine failed this request", None, (error or "error").split(":")[0],
                    "server_error")


class _Choices:
    """The samples' ChoiceTexts, and each one's echoed prompt (its text known up front, its logprobs later)."""

    def __init__(self, shape: Shape):
        parsed = shape.parsed
        self.prompt_of = [p for p, _ in parsed.samples]
        self.token_text = shape.texts
        echoes = [prompt_text(ids, None, shape.texts) if parsed.echo else Released() for ids in parsed.prompts]
        self.echo = [echoes[p] for p in self.prompt_of]
        self.texts = [ChoiceText(parsed.stops, len(echo.text), shape.texts) for echo in self.echo]
        self.echoed = [not parsed.echo] * len(self.texts)
        self.parsed = parsed

    def feed(self, index: int, event) -> Released:
        """The sample's new release, the echoed prompt first if it has not gone out yet."""
        out = Released()
        if not self.echoed[index] and (event.prompt_logprobs is not None or self.parsed.logprobs is None):
            ids = self.parsed.prompts[self.prompt_of[index]]
            out = prompt_text(ids, event.prompt_logprobs, self.token_text) if self.parsed.logprobs is not None \
                else Released(self.echo[index].text, list(self.echo[index].tokens))
            self.echoed[index] = True
        _extend(out, self.texts[index].feed(event.token_ids, event.logprobs))
        if event.finished and event.finish_reason != "error":
            _extend(out, self.texts[index].finish())
        return out

    @property
    def completion_tokens(self) -> int:
        return sum(text.kept for text in self.texts)


async def collect(samples: Samples, shape: Shape, request) -> Response:
    """Wait for every sample -> the JSON response (499 if the client left: nobody reads it)."""
    choices = _Choices(shape)
    released = [Released() for _ in choices.texts]
    reasons: list[str | None] = [None] * len(choices.texts)
    async for index, event in samples.events(request, poll=True):
        _extend(released[index], choices.feed(index, event))
        if choices.texts[index].stopped and reasons[index] is None:
            samples.stop(index)
            reasons[index] = "stop"
        if event.finished:
            if event.finish_reason == "error":
                samples.abort()
                return JSONResponse(engine_error(event.error).body(), status_code=500)
            reasons[index] = reasons[index] or event.finish_reason
    if None in reasons:
        return Response(status_code=499)
    parsed, order = shape.parsed, []
    for first in range(0, len(reasons), parsed.best_of):  # each prompt's best n, in sample order if all
        group = range(first, first + parsed.best_of)
        best = sorted(group, key=lambda i: -choices.texts[i].cumulative_logprob)[:parsed.n]
        order += best if parsed.best_of > parsed.n else list(group)
    return JSONResponse(shape.full([(released[i], reasons[i], choices.prompt_of[i]) for i in order],
                                   choices.completion_tokens))


async def stream(samples: Samples, shape: Shape, request):
    """Server-sent events: each sample's pieces as they come, its finish reason last, usage, then [DONE]."""
    choices = _Choices(shape)
    first = [True] * len(choices.texts)
    done = [False] * len(choices.texts)
    failed = False
    try:
        async for index, event in samples.events(request, poll=False):
            if done[index]:  # a sample already ended at a stop string: what the engine made after it is dropped
                continue
            if event.finished and event.finish_reason == "error":
                samples.abort()
                failed = True
                yield _data(engine_error(event.error).body())
                break
            echoing = not choices.echoed[index]
            piece = choices.feed(index, event)
            prompt = shape.parsed.prompts[choices.prompt_of[index]]
            echoed = len(prompt) if echoing and choices.echoed[index] else 0
            if piece:
                yield _data(shape.chunk(index, piece, None, first[index], echoed))
                first[index] = False
            stopped = choices.texts[index].stopped
            if stopped or event.finished:
                if stopped:
                    samples.stop(index)
                done[index] = True
                reason = "stop" if stopped else event.finish_reason
                yield _data(shape.chunk(index, Released(), reason, first[index]))
        if all(done) and shape.parsed.include_usage:
            yield _data(shape.usage_chunk(choices.completion_tokens))
        if all(done) or failed:
            yield "data: [DONE]\n\n"
    finally:
        if not (all(done) or failed):  # the client went away (Starlette cancelled us), the stream was cut or failed
            samples.abort()
            samples.worker.metrics.errors.labels(kind="client_disconnected").inc()


def _extend(into: Released, more: Released) -> None:
    into.text += more.text
    into.tokens += more.tokens


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
