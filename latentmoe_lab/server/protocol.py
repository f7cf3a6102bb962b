"""Request JSON -> a checked request, or an APIError naming the field (docs/design.md §10).

Fields taken (the README's table says, per field, what is supported and how); any other is refused by name:

    model              str, required: the served name (model.name of the service file)
    prompt             /v1/completions: a non-empty string (encoded with the model's tokenizer: bytes for our
                       checkpoints, a checkpoint's own tokenizer.json otherwise) or a list of token ids, or a list of
                       up to MAX_PROMPTS of either (choice index = prompt index * n + sample index)
    messages           /v1/chat/completions: [{"role": "system" | "user" | "assistant", "content": str or
                       [{"type": "text", "text": str}, ...]}, ...], rendered by the checkpoint's own chat template
                       when it ships one (chat_template.py), else by the plain template below
    max_tokens         int >= 1 (completions: 0 with echo, to score the prompt only); chat also takes
                       max_completion_tokens. Absent: the room left under max_model_len, at most
                       server.default_max_tokens. prompt + max_tokens > max_model_len: 400 naming both
    temperature        number >= 0 (default 1.0; below 1e-5 greedy, sampling.GREEDY_BELOW)
    top_p              number in (0, 1];  top_k  int >= 1 or null;  seed  int in [0, 2^64) or null
    presence_penalty, frequency_penalty   numbers in [-2, 2], over the generated tokens (sampling.py)
    logit_bias         {"token id": bias in [-100, 100]}
    stop               a string or a list of up to MAX_STOPS strings of 1..MAX_STOP_CHARS characters; the text
                       ends before the stop string that completes first (stops.py)
    n                  1..MAX_SAMPLES samples per prompt, each with its own generator (seed + i when seeded)
    best_of            completions: n..MAX_SAMPLES samples, the n with the highest cumulative logprob returned
    echo               completions: the prompt's text (and its logprobs) before the completion
    logprobs           completions: int 0..20 (each token's logprob and that many alternatives);
                       chat: bool, with top_logprobs int 0..20
    stream             bool: server-sent events; stream_options {"include_usage": bool}: a last usage chunk
    response_format    {"type": "text"} only;  user  str, ignored

The plain chat template (our checkpoints), one line per turn, then the assistant's cue (a base model, so plain
and byte-exact):

    <|system|>\n{content}\n<|user|>\n{content}\n<|assistant|>\n
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from latentmoe_lab.server.chat_template import CheckpointChatTemplate
from latentmoe_lab.server.choices import BYTES
from latentmoe_lab.server.errors import bad_request
from latentmoe_lab.server.fields import boolean, integer, json_type, number, text
from latentmoe_lab.serving import SamplingParams
from latentmoe_lab.serving.sampling import MAX_BIAS, MAX_LOGPROBS, MAX_PENALTY, SEED_LIMIT

COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                 "n", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "user")
FIELDS = {"completion": COMMON_FIELDS + ("prompt", "echo", "logprobs", "best_of"),
          "chat": COMMON_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")}
REFUSED = {"suffix": "this server has no fill-in-the-middle (insert) mode",
           "tools": "this server has no tool calling", "functions": "this server has no tool calling"}
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOPS = 4
MAX_STOP_CHARS = 256  # the stop matcher's work per token grows with this (stops.py)
MAX_SAMPLES = 16
MAX_PROMPTS = 64


@dataclass(frozen=True)
class ParsedRequest:
    """prompts: token ids of each prompt (one for chat); params: the sampling of the first prompt's samples
    (max_tokens may differ per prompt when defaulted: max_tokens); logprobs: alternatives per token, None =
    no logprobs in the answer."""

    kind: str  # "completion" or "chat"
    prompts: list[list[int]]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None
    include_usage: bool = False
    max_tokens: tuple[int, ...] = ()  # per prompt; () = params.max_tokens for all

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]

    @property
    def samples(self) -> list[tuple[int, SamplingParams]]:
        """(prompt index, params) of every engine request, best_of per prompt, prompt-major. Sample i of a
        prompt draws from its own generator, seeded seed + i when seeded (the request id otherwise); each
        scores its prompt when echo asks for logprobs."""
        seed = self.params.seed
        limits = self.max_tokens or (self.params.max_tokens,) * len(self.prompts)
        return [(p, dataclasses.replace(self.params, max_tokens=limits[p],
                                        seed=None if seed is None else (seed + i) % SEED_LIMIT))
                for p in range(len(self.prompts)) for i in range(self.best_of)]


def render_chat(messages: list[dict]) -> str:
    """The chat template of the module docstring: messages -> the prompt text."""
    turns = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(turns) + "<|assistant|>\n"


def parse_request(body, kind: str, served_model: str, vocab_size: int, max_model_len: int,
                  default_max_tokens: int = 256, encode: Callable[[str], list[int]] = BYTES.encode,
                  chat_template: CheckpointChatTemplate | None = None) -> ParsedRequest:
    """encode: prompt text -> ids, the served model's tokenizer (choices.TokenText.encode; bytes by default);
    chat_template: the checkpoint's own (TokenText.chat_template), None = render_chat."""
    if not isinstance(body, dict):
        raise bad_request(f"request body: expected a JSON object, got {json_type(body)}", None, "invalid_type")
    for name in body:
        if name not in FIELDS[kind]:
            why = REFUSED.get(name, "this server does not support the field")
            raise bad_request(f"{text(name, 'request body')[:100]}: {why}; supported: {', '.join(FIELDS[kind])}",
                              name[:100], "unsupported_field")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request(f"model: required, a string naming the served model ({served_model!r})", "model",
                          "invalid_type" if "model" in body else "missing")
    if model != served_model:
        raise bad_request(f"model: unknown model {model[:100]!r}; this server serves {served_model!r}", "model",
                          "model_not_found")
    if kind == "completion":
        prompts = _prompts(body.get("prompt"), "prompt" in body, vocab_size, encode)
    else:
        prompts = [_encoded(encode, _chat_text(_messages(body.get("messages"), "messages" in body), chat_template),
                            "messages")]
    field = "prompt" if kind == "completion" else "messages"
    for i, ids in enumerate(prompts):
        if len(ids) >= max_model_len:
            where = field if len(prompts) == 1 else f"{field}[{i}]"
            raise bad_request(f"{where}: {len(ids)} tokens leave no room to generate under max_model_len "
                              f"({max_model_len})", field, "context_length_exceeded")
    echo = boolean(body, "echo", False)
    stream = boolean(body, "stream", False)
    n = integer(body, "n", 1, 1, MAX_SAMPLES)
    best_of = integer(body, "best_of", n, 1, MAX_SAMPLES)
    if best_of < n:
        raise bad_request(f"best_of: must be >= n ({n}), got {best_of}", "best_of")
    if stream and best_of != n:
        raise bad_request("best_of: with stream, best_of must equal n (the best are known only at the end)",
                          "best_of")
    logprobs = _logprobs(body, kind)
    max_tokens = [_max_tokens(body, kind, echo, len(ids), max_model_len, default_max_tokens) for ids in prompts]
    _response_format(body.get("response_format"))
    if "user" in body and not isinstance(body["user"], str):
        raise bad_request(f"user: expected a string, got {json_type(body['user'])}", "user", "invalid_type")
    params = SamplingParams(
        max_tokens=max_tokens[0],
        temperature=number(body, "temperature", 1.0, 0.0),
        top_p=_top_p(body),
        top_k=integer(body, "top_k", None, 1),
        seed=integer(body, "seed", None, 0, SEED_LIMIT - 1),
        presence_penalty=number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        # a sample's own logprobs: asked for, or needed to rank best_of samples
        logprobs=logprobs if logprobs is not None or best_of == n else 0,
        prompt_logprobs=logprobs if echo else None)
    return ParsedRequest(kind, prompts, params, _stops(body.get("stop")), stream, n, best_of, echo, logprobs,
                         _include_usage(body.get("stream_options"), stream), tuple(max_tokens))


def _max_tokens(body: dict, kind: str, echo: bool, prompt_len: int, max_model_len: int, default: int) -> int:
    name = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise bad_request("max_completion_tokens: give it or max_tokens, not both", "max_completion_tokens")
        name = "max_completion_tokens"
    room = max_model_len - prompt_len
    value = integer(body, name, None, 0 if echo else 1)
    if value is None:
        return min(room, default)
    if value > room:
        raise bad_request(f"{name}: the prompt's {prompt_len} tokens + {name} {value} = {prompt_len + value} "
                          f"exceed max_model_len ({max_model_len})", name, "context_length_exceeded")
    return value


def _logprobs(body: dict, kind: str) -> int | None:
    if kind == "completion":
        return integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    wanted = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _top_p(body: dict) -> float:
    value = number(body, "top_p", 1.0, 0.0, 1.0)
    if value == 0:
        raise bad_request("top_p: must be in (0, 1], got 0", "top_p")
    return value


def _logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_request(f"logit_bias: expected an object {{token id: bias}}, got {json_type(bias)}", "logit_bias",
                          "invalid_type")
    out = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10 else -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key[:20]!r}",
                              "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise bad_request(f"logit_bias: the bias of token {token} must be a number in [-{MAX_BIAS:g}, "
                              f"{MAX_BIAS:g}]", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def _response_format(value) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "text" or len(value) != 1:
        shown = kind if isinstance(kind, str) else json_type(value)
        raise bad_request(f"response_format: only {{'type': 'text'}} is served (no JSON mode), got {shown[:50]!r}",
                          "response_format")


def _include_usage(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options: only with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options: expected an object, got {json_type(options)}", "stream_options",
                          "invalid_type")
    for key in options:
        if key != "include_usage":
            raise bad_request(f"stream_options.{key[:50]}: unsupported; supported: include_usage",
                              f"stream_options.{key[:50]}", "unsupported_field")
    return boolean(options, "include_usage", False)


def _prompts(prompt, given: bool, vocab_size: int, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """A prompt (a string or a list of token ids), or a list of them -> the token ids of each."""
    if not given or prompt is None:
        raise bad_request("prompt: required, a string or a list of token ids, or a list of those", "prompt",
                          "missing")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
        return [_prompt_ids(p, f"prompt[{i}]", vocab_size, encode) for i, p in enumerate(prompt)]
    return [_prompt_ids(prompt, "prompt", vocab_size, encode)]


def _chat_text(messages: list[dict], chat_template: CheckpointChatTemplate | None) -> str:
    """The prompt text of checked messages; 400 naming messages when the checkpoint's template refuses them."""
    if chat_template is None:
        return render_chat(messages)
    try:
        return chat_template.render(messages)
    except ValueError as error:
        raise bad_request(f"messages: {error}", "messages", "chat_template_error") from None


def _encoded(encode: Callable[[str], list[int]], prompt: str, where: str) -> list[int]:
    """The ids of a prompt's text; 400 naming `where` when the tokenizer refuses it (an id past the vocabulary)."""
    try:
        ids = encode(prompt)
    except ValueError as error:
        raise bad_request(f"{where}: {error}", where.partition("[")[0]) from None
    if not ids:
        raise bad_request(f"{where}: the tokenizer gives no tokens for this text", where.partition("[")[0],
                          "empty_prompt")
    return ids


def _prompt_ids(prompt, where: str, vocab_size: int, encode: Callable[[str], list[int]]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{where}: empty", "prompt", "empty_prompt")
        return _encoded(encode, text(prompt, where), where)
    if not isinstance(prompt, list):
        raise bad_request(f"{where}: expected a string or a list of token ids, got {json_type(prompt)}", "prompt",
                          "invalid_type")
    if not prompt:
        raise bad_request(f"{where}: empty", "prompt", "empty_prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad_request(f"{where}: expected a string or a list of integer token ids (or a list of those)",
                          "prompt", "invalid_type")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise bad_request(f"{where}: token ids must lie in [0, {vocab_size})", "prompt")
    return list(prompt)


def _messages(messages, given: bool) -> list[dict]:
    if not given or messages is None:
        raise bad_request("messages: required, a list of {role, content}", "messages", "missing")
    if not isinstance(messages, list):
        raise bad_request(f"messages: expected a list, got {json_type(messages)}", "messages", "invalid_type")
    if not messages:
        raise bad_request("messages: empty", "messages", "empty_prompt")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: expected an object, got {json_type(message)}", where, "invalid_type")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            name = text(extra[0], where)[:50]
            raise bad_request(f"{where}.{name}: unsupported message field", f"{where}.{name}", "unsupported_field")
        if message.get("role") not in CHAT_ROLES:
            raise bad_request(f"{where}.role: must be one of {list(CHAT_ROLES)}, got {str(message.get('role'))[:50]!r}",
                              f"{where}.role")
        out.append({"role": message["role"], "content": _content(message.get("content"), f"{where}.content")})
    if not any(m["content"] for m in out):
        raise bad_request("messages: every message is empty", "messages", "empty_prompt")
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return text(content, where)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}[{j}]: only text parts {{'type': 'text', 'text': str}} are served",
                                  f"{where}[{j}]", "invalid_type")
            texts.append(text(part["text"], f"{where}[{j}].text"))
        return "".join(texts)
    raise bad_request(f"{where}: expected a string or a list of text parts, got {json_type(content)}", where,
                      "invalid_type")


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop: expected a string or a list of strings, got {json_type(stop)}", "stop",
                          "invalid_type")
    if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop: at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters each", "stop")
    return tuple(stops)
