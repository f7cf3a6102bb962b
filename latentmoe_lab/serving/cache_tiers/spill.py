"""Prefix cache spill: evicted blocks and their KDA snapshots go to host, then disk, and come back on a hit
(docs/design.md §15.3).

The device prefix cache (block_manager.py) forgets a cached block when an allocation needs its room, and a
snapshot when a newer one needs its row. SpillingBlockManager copies them out first (BlockManager.evicting):

    device pools  --evict-->  host tier (serving/cache_tiers/spill_host.py, CPU tensors, memory.prefix_cache.host_bytes)
                  --LRU past host_bytes-->  disk tier (serving/cache_tiers/spill_disk.py, safetensors + SHA-256)

an entry per (block hash, kind): "rows" = the block's storage in every DSA layer (latent and index pools,
in the pools' own format, so fp8 rows stay fp8), "kda" = the snapshot at the block's end (every KDA layer's
fp32 state and conv tail, and with an MTP head the hidden row kept beside the snapshot, spec/hidden_rows.py).
A block hash names its whole prefix, so an entry is valid wherever it is found.

A hit (match_prefix) walks the hash chain across the three tiers: the longest run of blocks found
somewhere whose last block has a snapshot somewhere. Blocks not on the device are read back into freshly
allocated blocks and registered, the snapshot into a snapshot row, and the scheduler then copies that row
into the sequence's slot exactly as for a device hit: rows and snapshot come back together or not at all.
A disk entry that is missing, corrupt or another model's is refused (SpillRefused), deleted, and the
walk starts again without it, so the hit ends earlier and the rest is recomputed; a wrong file is never
served. When the device has no room for the blocks to come back, the device's own hit is used.

The disk directory is keyed (spill_key) by the SHA-256 of the model's weights and config, the cache formats
and the block size: another checkpoint, another kv_cache_dtype or another block size reads another
subdirectory (a miss), and a restarted engine of the same model finds its files again.

The pools may be the engine's own or its worker processes': the spill reads and writes them through the
runner (serving/cache_tiers/spill_blocks.py), and an entry has one layout either way, so a disk spill written
under one process layout serves another.
"""
from __future__ import annotations

import hashlib
import json
import logging

from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.cache_tiers.spill_blocks import KDA, ROWS, RunnerBlocks
from latentmoe_lab.serving.cache_tiers.spill_disk import DiskTier, SpillRefused, tensors_sha256
from latentmoe_lab.serving.cache_tiers.spill_host import Entry, HostTier, entry_bytes

DEVICE, HOST, DISK = "device", "host", "disk"
COUNTS = ("prefix_hits_device", "prefix_hits_host", "prefix_hits_disk", "prefix_hits_refused",
          "spill_bytes_device_to_host", "spill_bytes_host_to_device", "spill_bytes_disk_to_device")

log = logging.getLogger(__name__)


class SpillingBlockManager(BlockManager):
    """A BlockManager whose evicted prefix-cache entries move to a host tier and a disk tier.

    store: the pools' blocks and snapshot rows through the engine's runner (spill_blocks.py); host: the host
    tier, whose overflow goes to `disk` (or is dropped when disk is None). counts: shared with emptied() copies.
    """

    def __init__(self, store: RunnerBlocks, host: HostTier, disk: DiskTier | None, num_blocks: int, block_size: int,
                 num_slots: int, num_snapshots: int, counts: dict[str, int] | None = None):
        super().__init__(num_blocks, block_size, num_slots, num_snapshots, enable_prefix_caching=True)
        self.store = store
        self.host, self.disk = host, disk
        self.counts = counts if counts is not None else dict.fromkeys(COUNTS, 0)
        self.expected = {ROWS: self.store.shapes(ROWS), KDA: self.store.shapes(KDA)}

    def emptied(self) -> SpillingBlockManager:
        """Empty device bookkeeping over the same pools; the host and disk tiers and the counts stay."""
        return SpillingBlockManager(self.store, self.host, self.disk, self.num_blocks, self.block_size,
                                    self.num_slots, self.num_snapshots, self.counts)

    # ------------------------------------------------------------------ out
    def evicting(self, block_hash: bytes, block: int | None, snapshot_row: int | None) -> None:
        for kind, index in ((ROWS, block), (KDA, snapshot_row)):
            tensors = None if index is None else self.store.read(kind, index)
            if tensors is not None:  # None: the worker group was lost (spill_blocks.py)
                self.counts["spill_bytes_device_to_host"] += entry_bytes(tensors)
                self.host.put(block_hash, kind, tensors)

    def flush(self) -> None:
        """BlockManager.flush: every cached prefix still on the device or the host written to the disk tier (a file
        already there is kept), so that an engine started later on the same directory finds them."""
        if self.disk is None:
            return
        for (block_hash, kind), tensors in list(self.host.entries.items()):
            self.disk.put(block_hash, kind, tensors)
        for kind, named in ((ROWS, self.block_of_hash), (KDA, self.snapshot_of_hash)):
            for block_hash, index in list(named.items()):
                tensors = None if self.disk.has(block_hash, kind) else self.store.read(kind, index)
                if tensors is not None:
                    self.disk.put(block_hash, kind, tensors)

    # ------------------------------------------------------------------- in
    def match_prefix(self, block_hashes: list[bytes]) -> tuple[list[int], int | None]:
        """BlockManager.match_prefix over the device, host and disk tiers (see the module docstring)."""
        while True:
            rows_at: list[str] = []
            for block_hash in block_hashes:
                tier = self._locate(block_hash, ROWS)
                if tier is None:
                    break
                rows_at.append(tier)
            ends = [i + 1 for i in range(len(rows_at)) if self._locate(block_hashes[i], KDA) is not None]
            if not ends:
                return [], None
            hashes, tiers = block_hashes[:ends[-1]], rows_at[:ends[-1]]
            snapshot_at = self._locate(hashes[-1], KDA)
            if snapshot_at == DEVICE and set(tiers) == {DEVICE}:
                return self._device_hit(block_hashes)
            try:
                rows = {i: self._fetch(h, ROWS, tier) for i, (h, tier) in enumerate(zip(hashes, tiers))
                        if tier != DEVICE}
                snapshot = None if snapshot_at == DEVICE else self._fetch(hashes[-1], KDA, snapshot_at)
            except SpillRefused as error:
                self.counts["prefix_hits_refused"] += 1
                log.warning("prefix cache: a spilled entry was refused and its tokens will be recomputed: %s", error)
                continue  # the refused entry is gone: the chain now ends before it
            on_device = [self.block_of_hash[h] for h, tier in zip(hashes, tiers) if tier == DEVICE]
            pinned = sum(1 for block in on_device if self.ref_count[block] == 0)
            if len(rows) > self.num_free_blocks - pinned:
                return self._device_hit(block_hashes)  # no room to bring them back
            deepest = DISK if DISK in (*tiers, snapshot_at) else HOST
            self.counts[f"prefix_hits_{deepest}"] += 1
            return self._restore(hashes, tiers, rows, snapshot, snapshot_at)

    def _device_hit(self, block_hashes: list[bytes]) -> tuple[list[int], int | None]:
        blocks, row = super().match_prefix(block_hashes)
        self.counts["prefix_hits_device"] += bool(blocks)
        return blocks, row

    def _restore(self, hashes, tiers, rows: dict[int, Entry], snapshot: Entry | None, snapshot_at: str):
        # reference the resident blocks first, so that allocating the others cannot evict them
        for block_hash, tier in zip(hashes, tiers):
            if tier == DEVICE:
                block = self.block_of_hash[block_hash]
                if self.ref_count[block] == 0:
                    del self.evictable[block]
                self.ref_count[block] += 1
        fresh = iter(self.allocate_blocks(len(rows)))
        table, writes = [], []
        for i, (block_hash, tier) in enumerate(zip(hashes, tiers)):
            if tier == DEVICE:
                table.append(self.block_of_hash[block_hash])
                continue
            block = next(fresh)
            writes.append((ROWS, block, rows[i]))
            self.register_block(block_hash, block)
            self._brought_back(block_hash, ROWS, tier, rows[i])
            table.append(block)
        last = hashes[-1]
        if snapshot is None:
            row = self.snapshot_of_hash[last]
            self.snapshot_of_hash.move_to_end(last)
        else:
            row = self.snapshot_row_for(last)  # may evict (read) another snapshot row: before the write
            writes.append((KDA, row, snapshot))
            self._brought_back(last, KDA, snapshot_at, snapshot)
        self.store.write(writes)  # one message to worker processes for the whole hit
        return table, row

    def _brought_back(self, block_hash: bytes, kind: str, tier: str, tensors: Entry) -> None:
        """Count the bytes; a host entry moves (the device holds it again), a disk file stays for later."""
        self.counts[f"spill_bytes_{tier}_to_device"] += entry_bytes(tensors)
        if tier == HOST:
            self.host.discard(block_hash, kind)

    # ------------------------------------------------------------- helpers
    def _locate(self, block_hash: bytes, kind: str) -> str | None:
        if block_hash in (self.block_of_hash if kind == ROWS else self.snapshot_of_hash):
            return DEVICE
        if self.host.has(block_hash, kind):
            return HOST
        if self.disk is not None and self.disk.has(block_hash, kind):
            return DISK
        return None

    def _fetch(self, block_hash: bytes, kind: str, tier: str) -> Entry:
        if tier == HOST:
            return self.host.get(block_hash, kind)
        return self.disk.get(block_hash, kind, self.expected[kind], self.store.optional(kind))


def spill_key(model, plan, cache_dtype: str) -> tuple[str, dict]:
    """(key, what it describes): SHA-256 over the weights' hash, the model config, the cache formats and the
    block size, everything that decides the bytes of a spilled row or snapshot."""
    describes = {"weights_sha256": tensors_sha256(model.state_dict()),
                 "config_sha256": hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True,
                                                            default=str).encode()).hexdigest(),
                 "cache_dtype": cache_dtype, "conv_dtype": str(plan.dtype), "block_size": plan.block_size,
                 "latent_format": type(plan.latent_format).__name__,
                 "index_format": type(plan.index_format).__name__, "state_format": repr(plan.state_format),
                 "conv_format": repr(plan.conv_format)}
    return hashlib.sha256(json.dumps(describes, sort_keys=True).encode()).hexdigest(), describes


def block_manager_for(model, service, plan) -> BlockManager:
    """The engine's block manager: a SpillingBlockManager when memory.prefix_cache asks for a spill, over
    the pools of the runner that connect_runner hands it once the engine has built one."""
    memory = service.memory
    section = memory.prefix_cache
    if not section.spills:
        return BlockManager(plan.num_blocks, memory.block_size, plan.num_slots, plan.num_snapshots, section.enabled)
    disk = None
    if section.disk_dir is not None:
        key, describes = spill_key(model, plan, service.cache_dtype)
        disk = DiskTier(section.disk_dir, key, describes, section.disk_bytes)
    host = HostTier(section.host_bytes, None if disk is None else disk.put)
    return SpillingBlockManager(RunnerBlocks(model.config, plan), host, disk, plan.num_blocks, memory.block_size,
                                plan.num_slots, plan.num_snapshots)


def connect_runner(block_manager: BlockManager, runner, hidden_rows=None) -> None:
    """Give a spill the engine's runner (ModelRunner or ParallelRunner), once the engine has built it, and its
    MTP hidden rows (spec/hidden_rows.SlotHiddenRows, None without an MTP head), spilled with the snapshots."""
    if isinstance(block_manager, SpillingBlockManager):
        block_manager.store.runner, block_manager.store.hidden_rows = runner, hidden_rows


def spill_stats(block_manager: BlockManager) -> dict[str, int]:
    """The spill's counters for Engine.stats(): hits by tier, refused hits, bytes moved and held; {} without."""
    if not isinstance(block_manager, SpillingBlockManager):
        return {}
    disk = block_manager.disk
    return {**block_manager.counts,
            "spill_bytes_host_to_disk": 0 if disk is None else disk.bytes_written,
            "spill_disk_write_errors": 0 if disk is None else disk.write_errors,
            "spill_host_bytes": block_manager.host.nbytes, "spill_disk_bytes": 0 if disk is None else disk.nbytes}
