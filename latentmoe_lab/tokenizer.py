"""A byte-level tokenizer: token id = UTF-8 byte value. Nothing to download; any vocab >= 256 works.

Ids 256..259 hold the special tokens of the image spans (and padding); `VisionConfig` uses the same ids.
Id 260, "<bos>", marks the start of a document for evaluation harnesses (lm-eval's prefix token, see
tokenizer_files.py); encode never produces it, and training never sees it.

A checkpoint with a tokenizer.json of its own (a transformers checkpoint, docs/design.md §17) is encoded with it
instead (FileTokenizer, through the tokenizers library); load_tokenizer / tokenizer_of pick one or the other.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

NUM_BYTES = 256
SPECIAL_TOKENS = {"<image>": 256, "<image_start>": 257, "<image_end>": 258, "<pad>": 259, "<bos>": 260}
PAD_TOKEN_ID = SPECIAL_TOKENS["<pad>"]
BOS_TOKEN_ID = SPECIAL_TOKENS["<bos>"]
_SPECIAL_NAMES = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}


class ByteTokenizer:
    """Ids 0..255 are bytes, 256..260 the specials above; other ids decode as '?'."""

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


class FileTokenizer:
    """A checkpoint's own tokenizer.json through the tokenizers library, with ByteTokenizer's interface:
    encode(text) -> int64 ids [1, T] (no special tokens added), decode(ids) -> text."""

    def __init__(self, path, vocab_size: int):
        from tokenizers import Tokenizer

        self.path = str(path)
        self.vocab_size = vocab_size
        self._tokenizer = Tokenizer.from_file(self.path)

    def encode(self, text: str) -> torch.Tensor:
        if not isinstance(text, str) or not text:
            raise ValueError("text: expected a non-empty string")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"text: {self.path} gives id {max(ids)}, outside the model's vocab_size {self.vocab_size}")
        return torch.tensor([ids], dtype=torch.int64)

    def decode(self, ids) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self._tokenizer.decode(values, skip_special_tokens=False)


@functools.lru_cache(maxsize=8)  # a server encodes every text prompt with it: read tokenizer.json once
def load_tokenizer(directory, vocab_size: int) -> ByteTokenizer | FileTokenizer:
    """The tokenizer.json in `directory` (a checkpoint's own, docs/design.md §17), else the byte tokenizer.

    Our own save_pretrained writes the byte tokenizer's tokenizer.json, which gives the same ids as ByteTokenizer;
    it is read the fast way (ByteTokenizer) when config.json marks the directory as ours (no model_type).
    """
    if directory is None or not (Path(directory) / "tokenizer.json").is_file() or _is_ours(Path(directory)):
        return ByteTokenizer(vocab_size)
    return FileTokenizer(Path(directory) / "tokenizer.json", vocab_size)


def tokenizer_of(model) -> ByteTokenizer | FileTokenizer:
    """The tokenizer of a loaded model: its checkpoint's (from_pretrained records name_or_path), else bytes."""
    return load_tokenizer(getattr(model, "name_or_path", None), model.config.vocab_size)


def _is_ours(directory) -> bool:
    try:
        return "model_type" not in json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return True
