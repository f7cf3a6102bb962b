"""A host tier for the DSA latent rows, with a small device-resident hot buffer per sequence (docs/design.md §15).
(The KV cache's offload, memory.offload; parallel/offload.py offloads cold expert weights instead.)

At a million tokens one sequence's [c_kv | k_rope] rows dwarf everything else a device holds, yet a decode step
reads only the top-k of them per DSA layer. `OffloadedPools` therefore splits each DSA layer's pool in two:

    device tier   index keys [num_blocks, block_size, d_I]     the indexer scores every key at every step
                  hot buffer [hot_slots, hot_rows, row]         per running sequence (its KDA slot) and layer
    host tier     latent rows [num_blocks, block_size, row]     every row, on the CPU (pinned under CUDA)

Writes (prefill chunks and decodes alike) store latent rows in the host tier only. A prefill chunk reads the
rows it attends to straight from the host tier. A decode reads through `hot_reader`: the rows its attention
needs (the top-k selection; below top-k context, every visible row) are swapped into its slot's hot buffer
first, skipping those already hot and evicting the least recently used rows that this step does not read.
The hot copy holds the host row's encoded bytes, so attention sees exactly the values the plain pools would
give it (same format, same decode): outputs equal the plain path's bit for bit.

Invariant: a hot row always equals the host row at its position. Every write invalidates hot copies of the
positions written, in every slot, so a slot handed to another sequence, a freed and re-used block or a
prefix-shared block can never serve stale values; stale rows of a finished sequence are simply evicted.

Counters (`stats()`): rows and bytes swapped in, rows served hot, and host rows read by prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.paged_pools import DSAPool, PagedPools


class HotBuffer:
    """One DSA layer's device-resident rows: hot_rows encoded latent rows for each of hot_slots sequences.

    storage: the latent format's allocation of [hot_slots blocks of hot_rows tokens] on the device, read with
    the same format as the host tier; position [hot_slots, hot_rows] int64 (CPU): the flat host position
    each row holds, -1 when empty; last_used [hot_slots, hot_rows]: the step that last read it.
    """

    def __init__(self, fmt, dim: int, hot_slots: int, hot_rows: int, device):
        self.format, self.hot_slots, self.hot_rows = fmt, hot_slots, hot_rows
        self.storage = fmt.allocate(hot_slots, hot_rows, dim, device)
        self.rows = self.storage.view(hot_slots * hot_rows, -1)
        self.row_bytes = self.rows.shape[1] * self.rows.element_size()
        self.position = torch.full((hot_slots, hot_rows), -1, dtype=torch.long)
        self.last_used = torch.zeros(hot_slots, hot_rows, dtype=torch.long)
        self.clock = 0
        self.rows_moved = self.rows_hit = 0

    def invalidate(self, positions: torch.Tensor) -> None:
        """Forget hot copies of flat host positions [N] (they are being rewritten)."""
        self.position[torch.isin(self.position, positions.cpu())] = -1

    def swap_in(self, slot: int, positions: torch.Tensor, host_rows: torch.Tensor) -> torch.Tensor:
        """Make flat host positions [N] hot in `slot`; -> their flat rows [N] in self.rows (device).

        Copies only the positions not hot yet, into rows this call does not read (empty first, then the least
        recently used). host_rows: the host tier's row view [host positions, row].
        """
        if not 0 <= slot < self.hot_slots:
            raise ValueError(f"slot: a decoding sequence's slot must lie in [0, {self.hot_slots}) (the running "
                             f"slots that own hot buffers), got {slot}")
        positions = positions.cpu()
        wanted = positions.unique()
        if wanted.numel() > self.hot_rows:
            raise ValueError(f"memory.offload.hot_rows_per_layer: a decode reads {wanted.numel()} rows, more than "
                             f"the {self.hot_rows} of the hot buffer (it must be >= indexer.topk)")
        held = self.position[slot]
        missing = wanted[~torch.isin(wanted, held)]
        self.clock += 1
        if missing.numel():
            # eviction order: rows this call does not read, empty ones first, then the least recently used
            free = ~torch.isin(held, wanted)
            age = torch.where(held < 0, -1, self.last_used[slot])
            order = torch.argsort(torch.where(free, age, torch.iinfo(torch.long).max), stable=True)
            dest = order[:missing.numel()]
            self.rows[slot * self.hot_rows + dest.to(self.rows.device)] = host_rows[missing].to(
                self.rows.device, non_blocking=True)
            held[dest] = missing
        self.rows_moved += missing.numel()
        self.rows_hit += wanted.numel() - missing.numel()
        order = torch.argsort(held)
        found = order[torch.searchsorted(held[order], positions)]
        self.last_used[slot, found] = self.clock
        return (slot * self.hot_rows + found).to(self.rows.device)


@dataclass
class OffloadedDSAPool(DSAPool):
    """A DSAPool whose `latent` lives in the host tier; `index` stays on the device; `hot` is its HotBuffer."""

    offloaded: ClassVar[bool] = True  # decodes read hot buffers (hot_reader), prefill chunks the host (read_latent)
    hot: HotBuffer = None
    host_rows: torch.Tensor = None  # latent.view(host positions, row)
    host_reads: int = field(default=0)  # rows prefill chunks read from the host tier

    def write(self, slot_mapping: torch.Tensor, latent_rope: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """As DSAPool.write, the latent rows going to the host tier (hot copies of those positions dropped)."""
        host = self.latent.device
        self.hot.invalidate(slot_mapping)
        self.latent_format.write(self.latent, slot_mapping.to(host), latent_rope.detach().to(host))
        if index_keys is not None:
            self.index_format.write(self.index, slot_mapping, index_keys.detach())

    def read_latent(self, positions: torch.Tensor) -> torch.Tensor:
        """Latent rows [M, row] of flat positions [M] straight from the host tier (prefill chunks)."""
        self.host_reads += positions.numel()
        return self.latent_format.read(self.latent, positions.to(self.latent.device)).to(positions.device)

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_latent(positions), self.index_format.read(self.index, positions) if self.index.numel() else None

    def hot_reader(self, slots: list[int]):
        """A reader for decodes of sequences in KDA slots `slots` [B]: positions [B * N] (row b's N first) ->
        rows [B * N, row], each sequence's swapped into its own hot buffer first."""
        def read(positions: torch.Tensor) -> torch.Tensor:
            per_sequence = positions.view(len(slots), -1)
            rows = torch.cat([self.hot.swap_in(slot, flat, self.host_rows) for slot, flat in zip(slots, per_sequence)])
            return self.latent_format.read(self.hot.storage, rows)
        return read


class OffloadedPools(PagedPools):
    """PagedPools whose DSA layers are OffloadedDSAPools: latent rows on `host_device`, hot_rows per running
    slot (the first hot_slots KDA slots) and layer on `device`, index keys and KDA slots on `device`."""

    offloaded: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_slots: int, hot_rows: int,
                 hot_slots: int, dtype: torch.dtype = torch.float32, device=None, latent_format=None,
                 index_format=None, host_device="cpu", state_format=None, conv_format=None):
        for name, value, low in (("hot_rows", hot_rows, config.indexer.topk), ("hot_slots", hot_slots, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: must be an int >= {low}" + (" (indexer.topk: a decode reads up to "
                                 "top-k rows at once)" if name == "hot_rows" else "") + f", got {value!r}")
        if hot_slots > num_slots:
            raise ValueError(f"hot_slots: {hot_slots} exceeds num_slots ({num_slots})")
        self.hot_rows, self.hot_slots, self.host_device = hot_rows, hot_slots, torch.device(host_device)
        super().__init__(config, num_blocks, block_size, num_slots, dtype, device, latent_format, index_format,
                         state_format, conv_format)

    def _dsa_pool(self, d: dict[str, int], own_indexer: bool) -> OffloadedDSAPool:
        latent = self._allocate(self.latent_format, "latent_format", d["latent"], device=self.host_device)
        if self.device.type == "cuda":  # pinned pages: asynchronous copies into the hot buffers
            latent = latent.pin_memory()
        host_rows = latent.view(self.num_blocks * self.block_size, -1)
        _check_token_rows(self.latent_format, d["latent"])
        index = self._allocate(self.index_format, "index_format", d["index"], self.num_blocks if own_indexer else 0)
        hot = HotBuffer(self.latent_format, d["latent"], self.hot_slots, self.hot_rows, self.device)
        return OffloadedDSAPool(latent, index, self.latent_format, self.index_format, d["latent"], d["index"],
                                hot=hot, host_rows=host_rows)

    def _dsa_layers(self) -> list[OffloadedDSAPool]:
        return [pool for pool in self.layers if isinstance(pool, OffloadedDSAPool)]

    def nbytes(self) -> dict[str, int]:
        """Device bytes by kind (dsa_latent: the hot buffers), and the host tier as host_dsa_latent."""
        totals = super().nbytes()
        pools = self._dsa_layers()
        totals["dsa_latent"] = sum(p.hot.storage.numel() * p.hot.storage.element_size() for p in pools)
        totals["host_dsa_latent"] = sum(p.latent.numel() * p.latent.element_size() for p in pools)
        return totals

    def stats(self) -> dict[str, int]:
        """Totals since allocation, over every DSA layer: rows_moved / bytes_moved (host -> hot buffers),
        rows_hit (read hot, not moved), host_read_rows / host_read_bytes (prefill chunks' reads)."""
        pools = self._dsa_layers()
        row_bytes = pools[0].hot.row_bytes if pools else 0
        moved = sum(p.hot.rows_moved for p in pools)
        host = sum(p.host_reads for p in pools)
        return {"rows_moved": moved, "bytes_moved": moved * row_bytes, "rows_hit": sum(p.hot.rows_hit for p in pools),
                "host_read_rows": host, "host_read_bytes": host * row_bytes}


def offload_counters(parts: list[dict[str, int]]) -> dict[str, int]:
    """Engine.stats()'s host-tier counters, summed over `parts` (OffloadedPools.stats() of each pipeline stage:
    its first rank's; a stage's other ranks hold replicated rows and move the same ones):

        offload_rows_moved / offload_bytes_moved        host -> hot buffer swaps (a selected row not yet hot)
        offload_rows_hit                                selected rows served from the hot buffer, not moved
        offload_host_read_rows / offload_host_read_bytes   rows prefill chunks read straight from the host tier
    """
    keys = ("rows_moved", "bytes_moved", "rows_hit", "host_read_rows", "host_read_bytes")
    return {f"offload_{key}": sum(part[key] for part in parts) for key in keys}


def _check_token_rows(fmt, dim: int) -> None:
    """The hot buffer copies a token's row as raw storage bytes: refuse a latent format whose tokens are not
    contiguous rows of its storage (both shipped formats are)."""
    probe = fmt.allocate(2, 2, dim, "cpu")
    fmt.write(probe, torch.tensor([1]), torch.ones(1, dim))
    rows = probe.view(4, -1)
    if bool(rows[[0, 2, 3]].ne(0).any()) or not bool(rows[1].ne(0).any()):
        raise ValueError(f"latent_format: {type(fmt).__name__} does not store each token as one contiguous row; "
                         "the host tier copies rows between tiers as raw bytes")
