"""The OpenAI response and chunk objects of one request (docs/design.md §10).

    /v1/completions        {"choices": [{"index", "text", "logprobs", "finish_reason", "token_ids"}], "usage"}
        logprobs: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, over the echoed prompt's tokens
        (the first has null logprob and top_logprobs) and then the generated ones; top_logprobs maps the k
        most likely tokens and the chosen one to their logprobs (as vLLM does), text_offset is the character
        offset of each token in the choice's text
    /v1/chat/completions   {"choices": [{"index", "message" | "delta", "logprobs", "finish_reason", "token_ids"}]}
        logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [k of {"token", "logprob", "bytes"}]}]}

"token_ids" (the generated ids a choice's text came from) is an extension; OpenAI clients keep unknown fields.
usage counts each prompt once and every sample's tokens (best_of ones too) up to its end: at a stop string, up
to and including the token that completed it, the same tokens its logprobs and "token_ids" list.
"""
from __future__ import annotations

import time

from latentmoe_lab.server.choices import BYTES, Released, TokenText
from latentmoe_lab.server.protocol import ParsedRequest


class Shape:
    """texts: the served model's tokenizer, which the choices decode with and logprobs name tokens by."""

    def __init__(self, parsed: ParsedRequest, key: int, model: str, texts: TokenText = BYTES):
        self.parsed, self.kind, self.model, self.texts = parsed, parsed.kind, model, texts
        self.id = f"{'cmpl' if self.kind == 'completion' else 'chatcmpl'}-{key}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        prompt = sum(len(ids) for ids in self.parsed.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def full(self, choices: list[tuple[Released, str, int]], completion_tokens: int) -> dict:
        """choices: (everything the choice released, its finish reason, its prompt's index), in index order."""
        out = []
        for index, (released, reason, prompt) in enumerate(choices):
            echoed = len(self.parsed.prompts[prompt]) if self.parsed.echo else 0
            ids = [t for t, _, _ in released.tokens[echoed:]]
            choice = {"index": index, "logprobs": self._logprobs(released), "finish_reason": reason, "token_ids": ids}
            if self.kind == "completion":
                out.append({**choice, "text": released.text})
            else:
                out.append({**choice, "message": {"role": "assistant", "content": released.text}})
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return self._head(obj) | {"choices": out, "usage": self.usage(completion_tokens)}

    def chunk(self, index: int, released: Released, reason: str | None, first: bool, prompt_tokens: int = 0) -> dict:
        """One choice's piece; prompt_tokens: how many of released.tokens are echoed prompt tokens."""
        ids = [t for t, _, _ in released.tokens[prompt_tokens:]]
        choice = {"index": index, "logprobs": self._logprobs(released) if released.tokens else None,
                  "finish_reason": reason, "token_ids": ids}
        if self.kind == "completion":
            obj = self._head("text_completion") | {"choices": [{**choice, "text": released.text}]}
        else:
            delta = {"role": "assistant"} if first else {}
            if released.text:
                delta["content"] = released.text
            obj = self._head("chat.completion.chunk") | {"choices": [{**choice, "delta": delta}]}
        return obj | ({"usage": None} if self.parsed.include_usage else {})

    def usage_chunk(self, completion_tokens: int) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return self._head(obj) | {"choices": [], "usage": self.usage(completion_tokens)}

    def _logprobs(self, released: Released) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        if self.kind == "completion":
            return {"tokens": [self.texts.token_string(t) for t, _, _ in released.tokens],
                    "token_logprobs": [None if lp is None else lp.logprob for _, lp, _ in released.tokens],
                    "top_logprobs": [None if lp is None else self._top_object(lp) for _, lp, _ in released.tokens],
                    "text_offset": [offset for _, _, offset in released.tokens]}
        entry = self._chat_entry
        return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp, _ in released.tokens]}

    def _top_object(self, lp) -> dict:
        top = {self.texts.token_string(i): v for i, v in lp.top}
        top[self.texts.token_string(lp.token_id)] = lp.logprob
        return top

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.texts.token_string(token_id), "logprob": logprob,
                "bytes": self.texts.token_bytes(token_id)}
