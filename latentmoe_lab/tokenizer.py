"""A byte-level tokenizer: token id = UTF-8 byte value. Nothing to download, works for any vocab >= 256."""
from __future__ import annotations

import torch

NUM_BYTES = 256


class ByteTokenizer:
    """Ids 0..255 are bytes; ids >= 256 are left for special tokens and decode as U+FFFD."""

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
        """ids: a sequence or 1-D tensor of ints -> text (invalid bytes and specials become U+FFFD)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        data = bytes(v if 0 <= v < NUM_BYTES else 0x3F for v in values)
        return data.decode("utf-8", errors="replace")
