"""Blocks, KDA slots and the prefix cache: who owns which rows of the paged pools (docs/design.md §6.3, §6.5).

The pools (PagedPools) hold two kinds of rows:

    blocks     block_size tokens of every DSA layer's latent and index pools; a sequence holds a list
               of them (its block table). Full blocks may be shared by several sequences (refcounts).
    slots      one KDA state + conv tail for every KDA layer. Rows [0, num_slots) are running slots (a
               running sequence owns one); rows [num_slots, num_slots + num_snapshots) hold prefix-cache
               snapshots: a copy of some sequence's KDA state at the end of a full block.

Prefix caching. A full block is named by a hash chain: hash(previous block's hash, its token ids, the
content hashes of the images whose placeholders it holds), so equal hashes mean equal prefixes. A block
that finished computing is registered under its hash. When its sequence ends, it keeps its contents but
drops to refcount 0 and joins an LRU list: a later request with the same prefix takes it back; a request
that needs room evicts it. DSA blocks alone are not enough to resume a hybrid model: the KDA state at
that length is needed too. cached_chain_length finds the DSA hit (the longest registered chain) and
match_prefix the part of it a sequence resumes from: the longest registered chain whose LAST block has a
snapshot (both at the same length); serving/prefix_hits.py recomputes the tail between them. Snapshots
are copied, never shared, so any of them may be evicted at any time (LRU); evicting a block also drops
its snapshot.

Accounting: blocks_used counts blocks with refcount > 0 and slots_used running slots taken; both return
to 0 once every request has ended, while cached blocks and snapshots stay for later hits.
"""
from __future__ import annotations

from collections import OrderedDict, deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, num_snapshots: int = 0,
                 enable_prefix_caching: bool = False):
        for name, value, low in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                                 ("num_slots", num_slots, 1), ("num_snapshots", num_snapshots, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0 but cached, least recent first
        self.block_of_hash: dict[bytes, int] = {}
        self.hash_of_block: dict[int, bytes] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.free_snapshot_rows: list[int] = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.snapshot_of_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    # ------------------------------------------------------------------ counts
    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self.free_blocks) - len(self.evictable)

    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-used ones plus evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self.block_of_hash)

    @property
    def snapshots_held(self) -> int:
        return len(self.snapshot_of_hash)

    # ------------------------------------------------------------------ blocks
    def allocate_blocks(self, count: int) -> list[int]:
        """`count` fresh blocks at refcount 1 (free ones first, then the least recently used cached ones)."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"allocate_blocks: {count} blocks asked, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self.free_blocks:
                block = self.free_blocks.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                self._forget_block(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def release_blocks(self, blocks: list[int]) -> None:
        """Drop one reference to each block; an unreferenced block is freed, or kept as evictable if cached."""
        for block in blocks:
            if self.ref_count[block] <= 0:
                raise RuntimeError(f"release_blocks: block {block} is not referenced")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if block in self.hash_of_block:
                    self.evictable[block] = None  # newest at the end: evicted last
                else:
                    self.free_blocks.append(block)

    def _forget_block(self, block: int) -> None:
        block_hash = self.hash_of_block.pop(block, None)
        if block_hash is not None:
            del self.block_of_hash[block_hash]
            row = self.snapshot_of_hash.pop(block_hash, None)
            self.evicting(block_hash, block, row)
            if row is not None:
                self.free_snapshot_rows.append(row)

    def evicting(self, block_hash: bytes, block: int | None, snapshot_row: int | None) -> None:
        """Called just before an evicted cached block and/or snapshot row is reused (their contents still
        intact): here they are simply forgotten; serving/cache_tiers/spill.py copies them out to host and disk."""

    def flush(self) -> None:
        """When the engine closes: nothing to keep here; a spill (cache_tiers/spill.py) writes its prefixes to disk."""

    def emptied(self) -> BlockManager:
        """Empty bookkeeping of the same pools: no block or slot held, no prefix cached."""
        return BlockManager(self.num_blocks, self.block_size, self.num_slots, self.num_snapshots,
                            self.enable_prefix_caching)

    # ------------------------------------------------------------------- slots
    def acquire_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def release_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self.free_slots:
            raise RuntimeError(f"release_slot: slot {slot} is not held")
        self.free_slots.append(slot)

    # ------------------------------------------------------------ prefix cache
    def match_prefix(self, block_hashes: list[bytes]) -> tuple[list[int], int | None]:
        """Longest usable hit for a sequence whose first full blocks have these hashes: the longest registered
        chain whose last block has a snapshot, the snapshot nearest at or before the DSA hit.

        Returns (blocks, snapshot_row): the shared blocks, now referenced by the caller, and the pool row
        of the KDA snapshot at their end (copy it into the sequence's slot); ([], None) on a miss.
        """
        chain = self.cached_chain_length(block_hashes)
        hit = max((i + 1 for i in range(chain) if block_hashes[i] in self.snapshot_of_hash), default=0)
        if hit == 0:
            return [], None
        blocks = [self.block_of_hash[block_hash] for block_hash in block_hashes[:hit]]
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.evictable[block]
            self.ref_count[block] += 1
        row = self.snapshot_of_hash[block_hashes[hit - 1]]
        self.snapshot_of_hash.move_to_end(block_hashes[hit - 1])
        return blocks, row

    def cached_chain_length(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of this chain are registered: the DSA hit, in blocks (no snapshot asked for,
        nothing referenced); 0 with prefix caching off."""
        if not self.enable_prefix_caching:
            return 0
        length = 0
        while length < len(block_hashes) and block_hashes[length] in self.block_of_hash:
            length += 1
        return length

    def register_block(self, block_hash: bytes, block: int) -> None:
        """Name a computed full block by its hash (a block already cached under that hash keeps the name)."""
        if not self.enable_prefix_caching or block_hash in self.block_of_hash or block in self.hash_of_block:
            return
        self.block_of_hash[block_hash] = block
        self.hash_of_block[block] = block_hash

    def snapshot_row_for(self, block_hash: bytes) -> int | None:
        """A snapshot row to copy the KDA state at the end of this registered block into, or None.

        None when snapshots are off, the block is not registered, or it already has one (the state at
        a given prefix is the same whoever computed it). May evict the least recently used snapshot.
        """
        if (not self.enable_prefix_caching or self.num_snapshots == 0 or block_hash not in self.block_of_hash
                or block_hash in self.snapshot_of_hash):
            return None
        if not self.free_snapshot_rows:
            evicted_hash, row = self.snapshot_of_hash.popitem(last=False)
            self.evicting(evicted_hash, None, row)
            self.free_snapshot_rows.append(row)
        row = self.free_snapshot_rows.pop()
        self.snapshot_of_hash[block_hash] = row
        return row
