"""Generated ids -> text a few tokens at a time (docs/design.md §10), for SSE streaming: the pieces a request
sends, concatenated, equal one decode of all its ids.

IncrementalDetokenizer: the byte tokenizer (our own checkpoints). Byte tokens of one UTF-8 character may arrive
in different steps: an incremental UTF-8 decoder holds an unfinished character back until its last byte.
Special ids flush it (as ByteTokenizer.decode does, which decodes each run of bytes between specials on its
own), so the concatenated pieces equal ByteTokenizer.decode of all the ids, byte for byte.

RunningDetokenizer: a checkpoint's own tokenizer (tokenizer.FileTokenizer). Decoding each token on its own and
joining the pieces is wrong there: a byte-level BPE splits a character over tokens, and a SentencePiece-style
decoder drops the leading space of whatever it decodes first. So it decodes the running ids and sends the new
suffix: the text of a window of the latest ids, minus the text of the window without the new ones (both begin
at the same place, so a decoder's treatment of the start cancels). A text that ends in U+FFFD may be an
unfinished character: it is held back until a later token completes it, or the request ends. The window
starts where the previous piece started, a place where the text decoded completely, so its decode continues
the whole decode's; it stays a few tokens long (it only grows while a character is unfinished).
"""
from __future__ import annotations

import codecs

from latentmoe_lab.tokenizer import NUM_BYTES, SPECIAL_TOKENS

_SPECIAL_NAMES = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}
REPLACEMENT = "\ufffd"  # what a decode gives for an unfinished (or invalid) UTF-8 character


class IncrementalDetokenizer:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        """The text these ids complete (possibly empty while a character is unfinished)."""
        pieces = []
        for token_id in token_ids:
            if token_id in _SPECIAL_NAMES:
                pieces += [self._decoder.decode(b"", final=True), _SPECIAL_NAMES[token_id]]
                self._decoder.reset()
            else:
                byte = token_id if 0 <= token_id < NUM_BYTES else 0x3F  # other ids decode as '?'
                pieces.append(self._decoder.decode(bytes([byte])))
        return "".join(pieces)

    def flush(self) -> str:
        """At the end of the request: an unfinished character becomes U+FFFD, as a whole decode gives."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class RunningDetokenizer:
    """tokenizer: anything with decode(list of ids) -> str (a FileTokenizer). feed / flush as above; the pieces
    concatenated equal tokenizer.decode(all ids)."""

    def __init__(self, tokenizer):
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._start = 0  # the window's first id: the text of the ids before it is out
        self._sent = 0  # the ids whose text is out: ids[:_sent]
        self._sent_text = ""  # decode(ids[_start:_sent]), the part of the window's text already out

    def feed(self, token_ids: list[int]) -> str:
        """The text these ids add (empty while it ends in an unfinished character, or they add none)."""
        self._ids += token_ids
        text = self._decode(self._ids[self._start:])
        if len(text) <= len(self._sent_text) or text.endswith(REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """At the end of the request: whatever is held back (an unfinished character as U+FFFD)."""
        if self._sent == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids[self._start:]))

    def _advance(self, text: str) -> str:
        """Send what `text` (the window's decode) adds; the next window starts at the first id not yet sent."""
        piece = text[len(self._sent_text):]
        self._start, self._sent = self._sent, len(self._ids)
        self._sent_text = self._decode(self._ids[self._start:self._sent])
        return piece
