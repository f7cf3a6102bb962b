"""Request JSON -> a checked request, or an APIError naming the field (docs/design.md §10).

Fields taken (the OpenAI ones that make sense for this engine); any other field is refused by name:

    model        str, required: the served name (model.name of the service file)
    prompt       /v1/completions: a non-empty string (byte tokens) or a list of token ids
    messages     /v1/chat/completions: [{"role": "system" | "user" | "assistant", "content": str or
                 [{"type": "text", "text": str}, ...]}, ...], rendered by CHAT_TEMPLATE below
    max_tokens   int >= 1 (default 16); capped by the room left under model.max_model_len
    temperature  number >= 0 (default 1.0 as in the OpenAI API; 0 = greedy)
    top_p        number in (0, 1];  top_k  int >= 1 or null;  seed  int >= 0 or null
    stop         a string or a list of up to 4 non-empty strings; the text ends before the first one
    stream       bool: server-sent events
    n            1 only

The chat template, one line per turn, then the assistant's cue (a base model, so plain and byte-exact):

    <|system|>\n{content}\n<|user|>\n{content}\n<|assistant|>\n
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from latentmoe_lab.server.errors import bad_request
from latentmoe_lab.serving import SamplingParams

COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n")
FIELDS = {"completion": COMMON_FIELDS + ("prompt",), "chat": COMMON_FIELDS + ("messages",)}
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOPS = 4


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool


def render_chat(messages: list[dict]) -> str:
    """The chat template of the module docstring: messages -> the prompt text."""
    turns = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(turns) + "<|assistant|>\n"


def parse_request(body, kind: str, served_model: str, vocab_size: int, max_model_len: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request(f"request body: expected a JSON object, got {_json_type(body)}", None, "invalid_type")
    for name in body:
        if name not in FIELDS[kind]:
            raise bad_request(f"{name}: this server does not support the field {name!r}; supported: "
                              f"{', '.join(FIELDS[kind])}", name, "unsupported_field")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request(f"model: required, a string naming the served model ({served_model!r})", "model",
                          "invalid_type" if "model" in body else "missing")
    if model != served_model:
        raise bad_request(f"model: unknown model {model!r}; this server serves {served_model!r}", "model",
                          "model_not_found")
    if kind == "completion":
        prompt_ids = _prompt_ids(body.get("prompt"), "prompt" in body, vocab_size)
    else:
        prompt_ids = list(render_chat(_messages(body.get("messages"), "messages" in body)).encode("utf-8"))
    field = "prompt" if kind == "completion" else "messages"
    if len(prompt_ids) >= max_model_len:
        raise bad_request(f"{field}: {len(prompt_ids)} tokens leave no room to generate under max_model_len "
                          f"({max_model_len})", field, "context_length_exceeded")
    n = _integer(body, "n", 1, minimum=1)
    if n != 1:
        raise bad_request(f"n: only n=1 is served, got {n}", "n")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream: expected true or false, got {_json_type(stream)}", "stream", "invalid_type")
    params = SamplingParams(
        max_tokens=_integer(body, "max_tokens", 16, minimum=1),
        temperature=_number(body, "temperature", 1.0, lambda x: x >= 0, ">= 0"),
        top_p=_number(body, "top_p", 1.0, lambda x: 0 < x <= 1, "in (0, 1]"),
        top_k=_integer(body, "top_k", None, minimum=1),
        seed=_integer(body, "seed", None, minimum=0))
    return ParsedRequest(kind, prompt_ids, params, _stops(body.get("stop")), bool(stream))


def _prompt_ids(prompt, given: bool, vocab_size: int) -> list[int]:
    if not given or prompt is None:
        raise bad_request("prompt: required, a string or a list of token ids", "prompt", "missing")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt: empty", "prompt", "empty_prompt")
        return list(prompt.encode("utf-8"))
    if not isinstance(prompt, list):
        raise bad_request(f"prompt: expected a string or a list of token ids, got {_json_type(prompt)}", "prompt",
                          "invalid_type")
    if not prompt:
        raise bad_request("prompt: empty", "prompt", "empty_prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad_request("prompt: one prompt per request: a string or a list of integer token ids", "prompt",
                          "invalid_type")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise bad_request(f"prompt: token ids must lie in [0, {vocab_size})", "prompt")
    return list(prompt)


def _messages(messages, given: bool) -> list[dict]:
    if not given or messages is None:
        raise bad_request("messages: required, a list of {role, content}", "messages", "missing")
    if not isinstance(messages, list):
        raise bad_request(f"messages: expected a list, got {_json_type(messages)}", "messages", "invalid_type")
    if not messages:
        raise bad_request("messages: empty", "messages", "empty_prompt")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: expected an object, got {_json_type(message)}", where, "invalid_type")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise bad_request(f"{where}.{extra[0]}: unsupported message field", f"{where}.{extra[0]}",
                              "unsupported_field")
        if message.get("role") not in CHAT_ROLES:
            raise bad_request(f"{where}.role: must be one of {list(CHAT_ROLES)}, got {message.get('role')!r}",
                              f"{where}.role")
        out.append({"role": message["role"], "content": _content(message.get("content"), f"{where}.content")})
    if not any(m["content"] for m in out):
        raise bad_request("messages: every message is empty", "messages", "empty_prompt")
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}[{j}]: only text parts {{'type': 'text', 'text': str}} are served",
                                  f"{where}[{j}]", "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}: expected a string or a list of text parts, got {_json_type(content)}", where,
                      "invalid_type")


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop: expected a string or a list of strings, got {_json_type(stop)}", "stop",
                          "invalid_type")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise bad_request(f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    return tuple(stops)


def _integer(body: dict, name: str, default, minimum: int):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name}: expected an integer, got {_json_type(value)}", name, "invalid_type")
    if value < minimum:
        raise bad_request(f"{name}: must be >= {minimum}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, ok, rule: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name}: expected a number, got {_json_type(value)}", name, "invalid_type")
    if not math.isfinite(value) or not ok(value):
        raise bad_request(f"{name}: must be {rule}, got {value}", name)
    return float(value)


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
