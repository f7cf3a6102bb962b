"""Generated ids -> text one token at a time (docs/design.md §10), for SSE streaming.

Byte tokens of one UTF-8 character may arrive in different steps: an incremental UTF-8 decoder holds
an unfinished character back until its last byte. Special ids flush it (as ByteTokenizer.decode does,
which decodes each run of bytes between specials on its own), so the concatenated pieces equal
ByteTokenizer.decode of all the ids, byte for byte.
"""
from __future__ import annotations

import codecs

from latentmoe_lab.tokenizer import NUM_BYTES, SPECIAL_TOKENS

_SPECIAL_NAMES = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}


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
