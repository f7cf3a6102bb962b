"""The host tier of the prefix-cache spill: CPU copies of evicted blocks and snapshots, bounded by bytes.

An entry is (block hash, kind) -> {tensor name: CPU tensor}; kind "rows" is a block's DSA rows (every DSA
layer's latent and index storage), "kda" the KDA snapshot at the block's end (every KDA layer's state and
conv tail). Least recently used entries leave first when a put goes past `max_bytes`: they are handed to
`demote` (the disk tier's put, or nothing: dropped). With max_bytes 0 every entry goes straight through.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

Entry = dict[str, torch.Tensor]


def entry_bytes(tensors: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HostTier:
    def __init__(self, max_bytes: int, demote: Callable[[bytes, str, Entry], None] | None = None):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"memory.prefix_cache.host_bytes: must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes, self.demote = max_bytes, demote
        self.entries: OrderedDict[tuple[bytes, str], Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def has(self, block_hash: bytes, kind: str) -> bool:
        return (block_hash, kind) in self.entries

    def get(self, block_hash: bytes, kind: str) -> Entry:
        self.entries.move_to_end((block_hash, kind))
        return self.entries[(block_hash, kind)]

    def put(self, block_hash: bytes, kind: str, tensors: Entry) -> None:
        """Keep an entry (replacing one of the same key), demoting the least recently used past max_bytes."""
        self.discard(block_hash, kind)
        self.entries[(block_hash, kind)] = tensors
        self.nbytes += entry_bytes(tensors)
        while self.nbytes > self.max_bytes:
            (old_hash, old_kind), old = self.entries.popitem(last=False)
            self.nbytes -= entry_bytes(old)
            if self.demote is not None:
                self.demote(old_hash, old_kind, old)

    def discard(self, block_hash: bytes, kind: str) -> None:
        old = self.entries.pop((block_hash, kind), None)
        if old is not None:
            self.nbytes -= entry_bytes(old)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
