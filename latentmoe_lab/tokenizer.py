"""A byte-level tokenizer: token id = UTF-8 byte value. Nothing to download; any vocab >= 256 works.

Ids 256..259 hold the special tokens of the image spans (and padding); `VisionConfig` uses the same ids.
"""
from __future__ import annotations

import torch

NUM_BYTES = 256
SPECIAL_TOKENS = {"<image>": 256, "<image_start>": 257, "<image_end>": 258, "<pad>": 259}
PAD_TOKEN_ID = SPECIAL_TOKENS["<pad>"]
_SPECIAL_NAMES = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}


class ByteTokenizer:
    """Ids 0..255 are bytes, 256..259 the specials above; other ids decode as '?'."""

    def __init__(self, vocab_size: int):
        if vocab_size < NUM_BYTES:
            raise ValueError(f"vocab_size: a byte tokenizer needs >= {NUM_BYTES} ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> torch.Tensor:
        """text -> int64 ids [1, T]."""
        if not isinstance(text, str) or not text:
            raise ValueError("text: expected a non-empty string")
        return torch.tensor([list(text.encode("utf-8"))], dtype=torch.int64)

    def decode(self, ids) -> str:
        """ids: a sequence or 1-D tensor of ints -> text; specials print as their names, e.g. '<image>'."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        pieces, run = [], []
        for value in values:
            if value in _SPECIAL_NAMES:
                pieces += [bytes(run).decode("utf-8", errors="replace"), _SPECIAL_NAMES[value]]
                run = []
            else:
                run.append(value if 0 <= value < NUM_BYTES else 0x3F)
        return "".join(pieces) + bytes(run).decode("utf-8", errors="replace")
