"""The batched MTP drafter's paged rows: one DSAPool per MTP depth, one block table per request.

Depth k's row at position s of a request (its c_kv | k_rope and index key) lives at the same flat pool
position in every depth's pool, through the request's block table, as the target's rows do in the
engine's pools (paged_pools.py). The drafter owns these pools: they hold rows only the MTP head reads.
Like the serial drafter's per-request caches they grow with the requests they serve (not planned by
serving/planner.py): when the free list runs dry every pool doubles its blocks, the old rows copied.
A released request's blocks go back to the free list at once.
"""
from __future__ import annotations

import torch

from latentmoe_lab.paged_pools import DSAPool, PlainFormat


class DraftPools:
    """pools[k - 1]: depth k's DSAPool (model dtype, blocks of block_size tokens); tables: request -> blocks."""

    def __init__(self, model, block_size: int = 16, num_blocks: int = 16):
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        config, parameter = model.config, next(model.mtp.parameters())
        self.block_size, self.num_blocks = block_size, 0
        self.format = PlainFormat(parameter.dtype)
        self.device = parameter.device
        latent_dim = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
        self.pools = [DSAPool(self._empty(latent_dim), self._empty(config.indexer.head_dim), self.format,
                              self.format, latent_dim, config.indexer.head_dim) for _ in model.mtp.depths]
        # a depth without an indexer (dsa.use_indexer False) keeps no index keys: its index pool stays empty
        self.has_index = [depth.block.attn.indexer is not None for depth in model.mtp.depths]
        self.free: list[int] = []
        self.tables: dict[int, list[int]] = {}
        self._grow(num_blocks)

    def _empty(self, dim: int) -> torch.Tensor:
        return self.format.allocate(0, self.block_size, dim, self.device)

    def _grow(self, extra: int) -> None:
        """Add `extra` blocks to every pool (a copy of the old rows) and to the free list."""
        old, new = self.num_blocks, self.num_blocks + extra
        for pool, indexed in zip(self.pools, self.has_index):
            for name in ("latent", "index"):
                if name == "index" and not indexed:
                    continue
                held = getattr(pool, name)
                grown = self.format.allocate(new, self.block_size, held.shape[-1], self.device)
                grown[:old] = held
                setattr(pool, name, grown)
        self.free.extend(range(new - 1, old - 1, -1))
        self.num_blocks = new

    def reserve(self, request_id: int, tokens: int) -> list[int]:
        """The request's block table, grown to cover positions 0 .. tokens - 1."""
        table = self.tables.setdefault(request_id, [])
        needed = -(-tokens // self.block_size) - len(table)
        if needed > len(self.free):
            self._grow(max(needed - len(self.free), self.num_blocks))
        table.extend(self.free.pop() for _ in range(max(0, needed)))
        return table

    def release(self, request_id: int) -> None:
        self.free.extend(reversed(self.tables.pop(request_id, [])))

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self.free)
