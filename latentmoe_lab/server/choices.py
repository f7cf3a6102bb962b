"""One choice (sample) of a response as its tokens arrive: text, tokens and logprobs (docs/design.md §10).

Generated ids are detokenized one token at a time and cut at the first stop string (stops.py). A token is
released together with the text it completes: one whose text the stop matcher still holds back waits. A
choice ends at the token whose text completes a stop string, as the public servers count it: that token and
every one before it are kept (in `tokens`, the logprobs, `token_ids` and usage; those inside the stop string
have text offsets at or past the cut text's end), and the tokens the engine made after it, before the abort
reached it, are dropped, so what a request returns does not depend on step timing. The first bytes of a
multi-byte character release no text of their own: they share the offset of the character their last byte
completes.

Token strings in logprobs: a byte < 0x80 is its character, a special id its name, a byte >= 0x80 (part of
a UTF-8 character) "bytes:\\xNN", so that the keys of a completions top_logprobs object never collide.

A checkpoint with its own tokenizer (TokenText over a FileTokenizer) decodes through it (detokenizer.py's
RunningDetokenizer); a token's string is the text it decodes to alone, and its bytes that text's UTF-8. A token
that is only part of a character (or decodes to nothing) is "token_id:N", with bytes null (as OpenAI allows),
so that such tokens' keys never collide either.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from latentmoe_lab.server.chat_template import CheckpointChatTemplate, chat_template_of
from latentmoe_lab.server.detokenizer import REPLACEMENT, IncrementalDetokenizer, RunningDetokenizer
from latentmoe_lab.server.stops import StopMatcher
from latentmoe_lab.serving.logprobs import TokenLogprob
from latentmoe_lab.tokenizer import NUM_BYTES, SPECIAL_TOKENS, ByteTokenizer, tokenizer_of

_SPECIAL_NAMES = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}


@dataclass
class Released:
    """What a choice releases at once: text, and (token id, logprob or None, text offset) per token."""

    text: str = ""
    tokens: list[tuple[int, TokenLogprob | None, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens)


class TokenText:
    """Ids -> text with the tokenizer the served model came with: tokenizer.tokenizer_of(model), the one object the
    engine encodes text prompts with; None or a ByteTokenizer (our own checkpoints) keeps the byte rules.
    chat_template: the checkpoint's own (chat_template.py), None = the plain template of protocol.py."""

    def __init__(self, tokenizer=None, chat_template: CheckpointChatTemplate | None = None):
        self.tokenizer = None if isinstance(tokenizer, ByteTokenizer) else tokenizer
        self.chat_template = chat_template

    @classmethod
    def of(cls, model) -> "TokenText":
        """The served model's: tokenizer_of(model) and the chat template beside it, each read once and cached. A
        model of fewer than 256 ids without a tokenizer.json has no byte tokenizer (ValueError); the byte rules
        still decode the ids it makes."""
        try:
            tokenizer = tokenizer_of(model)
        except ValueError:
            return BYTES
        return cls(tokenizer, chat_template_of(tokenizer))

    def encode(self, text: str) -> list[int]:
        """A prompt's text -> its ids (ValueError: an id outside the model's vocabulary)."""
        return list(text.encode("utf-8")) if self.tokenizer is None else self.tokenizer.encode(text)[0].tolist()

    def detokenizer(self) -> IncrementalDetokenizer | RunningDetokenizer:
        return IncrementalDetokenizer() if self.tokenizer is None else RunningDetokenizer(self.tokenizer)

    def token_string(self, token_id: int) -> str:
        if self.tokenizer is None:
            return token_string(token_id)
        text = self._whole_text(token_id)
        return f"token_id:{token_id}" if text is None else text

    def token_bytes(self, token_id: int) -> list[int] | None:
        if self.tokenizer is None:
            return token_bytes(token_id)
        text = self._whole_text(token_id)
        return None if text is None else list(text.encode("utf-8"))

    def _whole_text(self, token_id: int) -> str | None:
        """The text the token decodes to alone; None when that is nothing or holds part of a character."""
        text = self.tokenizer.decode([token_id])
        return None if not text or REPLACEMENT in text else text


BYTES = TokenText()


class ChoiceText:
    def __init__(self, stops: tuple[str, ...], offset: int = 0, texts: TokenText = BYTES):
        self._detokenizer, self._stops = texts.detokenizer(), StopMatcher(stops)
        self._offset = offset  # characters before this choice's text (an echoed prompt)
        self._decoded = 0  # characters detokenized so far
        self._released = 0  # characters released so far
        self._pending: list[tuple[int, TokenLogprob | None, int, int]] = []  # id, logprob, start, end
        self.kept = 0  # tokens of this choice: every one fed, up to and including the one that completed a stop
        self.cumulative_logprob = 0.0  # over the kept tokens

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def feed(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> Released:
        """New ids (and their logprobs, [] when not asked for) -> what can go to the client now. Ids past the
        one that completed a stop string (made before the abort reached the engine) are ignored."""
        text = []
        for i, token_id in enumerate(token_ids):
            if self.stopped:
                break
            logprob = logprobs[i] if logprobs else None
            self.kept += 1
            self.cumulative_logprob += logprob.logprob if logprob else 0.0
            piece = self._detokenizer.feed([token_id])
            self._pending.append((token_id, logprob, self._decoded, self._decoded + len(piece)))
            self._decoded += len(piece)
            text.append(self._stops.feed(piece))  # token by token: the one that completes a stop is known
        return self._release("".join(text))

    def finish(self) -> Released:
        """At the end of the request: an unfinished character, the held-back tail, every token left."""
        if self.stopped:
            return Released()
        tail = self._detokenizer.flush()
        if tail and self._pending:  # the unfinished character belongs to the last tokens
            token_id, logprob, start, end = self._pending[-1]
            self._pending[-1] = (token_id, logprob, start, end + len(tail))
        text = self._stops.feed(tail) + self._stops.flush()
        self._decoded += len(tail)
        released = self._release(text)
        released.tokens += [(t, lp, self._offset + start) for t, lp, start, _ in self._pending]
        self._pending = []
        return released

    def _release(self, text: str) -> Released:
        """text: newly released characters -> it, with the tokens whose text it completes (at a stop: every
        token left, the last of them the one that completed the stop)."""
        self._released += len(text)
        count = len(self._pending) if self.stopped else 0
        while count < len(self._pending) and self._pending[count][3] <= self._released:
            count += 1
        out = [(t, lp, self._offset + start) for t, lp, start, _ in self._pending[:count]]
        self._pending = self._pending[count:]
        return Released(text, out)


def prompt_text(prompt_ids: list[int], logprobs: list[TokenLogprob] | None, texts: TokenText = BYTES) -> Released:
    """The echoed prompt: its text and tokens (the first has no logprob; the others logprobs[i - 1])."""
    detokenizer, tokens, text = texts.detokenizer(), [], []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        logprob = logprobs[i - 1] if logprobs is not None and i > 0 else None
        tokens.append((token_id, logprob, offset))
        piece = detokenizer.feed([token_id])
        text.append(piece)
        offset += len(piece)
    text.append(detokenizer.flush())
    return Released("".join(text), tokens)


def token_string(token_id: int) -> str:
    if token_id in _SPECIAL_NAMES:
        return _SPECIAL_NAMES[token_id]
    if 0 <= token_id < 0x80:
        return chr(token_id)
    if token_id < NUM_BYTES:
        return f"bytes:\\x{token_id:02x}"
    return f"token_id:{token_id}"


def token_bytes(token_id: int) -> list[int]:
    """The bytes this token adds to the text (a chat logprobs entry's `bytes`): a byte itself, a special's name,
    b'?' for an id past the byte vocabulary (decoded as '?'), so that the entries' bytes rebuild the content."""
    if token_id in _SPECIAL_NAMES:
        return list(_SPECIAL_NAMES[token_id].encode())
    return [token_id] if 0 <= token_id < NUM_BYTES else list(b"?")
