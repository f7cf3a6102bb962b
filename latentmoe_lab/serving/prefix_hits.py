"""Hybrid prefix hits at any block boundary: the DSA hit, the KDA hit, the tail between (docs/design.md §6.5).

A cached prefix of a hybrid model has two kinds of state, and the prefix cache (block_manager.py) holds them
at different places:

    DSA rows    per token, in full blocks named by the hash chain: cached for every full block a request computed
    KDA state   one per sequence, cached only where a snapshot was taken (a chunk end or a decode step that
                fell on a block boundary), in a snapshot row

find_prefix_hit looks both up for the first full blocks of a prompt:

    h  the DSA hit: the longest run of the chain whose blocks are cached, at any block boundary
    s  the KDA hit: the longest part of that run whose last block has a snapshot, i.e. the snapshot nearest
       at or before h (0: none); BlockManager.match_prefix finds it and references the blocks of [0, s)

    tokens  0 ............ s ................ h ......... T
            shared blocks   tail: recomputed    the rest of the prompt
            + the snapshot  (DSA and KDA)

The sequence resumes at s: it shares the blocks of [0, s), copies the snapshot at s into its KDA slot, and
computes [s, h) again, DSA rows and KDA state alike, into blocks of its own. An attention hit never implies
a state: with the snapshot at h evicted, or never taken, the state comes from the last snapshot before it,
or from zero. Why recompute the tail's DSA rows as well, rather than run the tail for its KDA state only
and read its DSA rows from the cached blocks? Either way every layer runs on the tail's tokens (a KDA
layer's input is the output of the layers below it, DSA ones included), so the forward costs the same; but
the tail is then an ordinary prefill from a snapshot, the same computation as a hit at s, so it is exact
wherever a hit at s is (bit for bit under scheduler.batch_invariant, tests/test_prefix_any_split.py), shared
blocks are never written, and the model runner needs nothing new. The price is the tail's blocks, held
twice while the sequence runs (its own copies are never registered: the cached blocks keep the names).

What the DSA hit buys is a place for the next snapshot. The tail's last chunk ends AT h (chunk_end), so
that a snapshot is taken there, and the next request with that prefix hits at h in full. h is where the
prompt leaves every cached prefix: for a shared system prompt followed by per-request text, the last block
boundary of the system prompt. Its first request caches the blocks (its own chunk ended at the last boundary
of ITS prompt, past the divergence), the second finds them and leaves the snapshot, and every later one hits
there. The other placements were there before: the last block boundary before the end of each prompt (a
chunk that crosses a boundary ends at the last one it crosses) and every boundary a decode reaches (the end
of each turn). Without chunked prefill a prompt runs whole in one step, and no cut is made.

Counts (Engine.stats(), /metrics), over admitted sequences:
    prefix_hit_tokens            s summed: tokens a hit skipped (Scheduler.prefix_hit_tokens, as before)
    prefix_dsa_hit_tokens        h summed: tokens whose DSA rows were found cached
    prefix_kda_snapshots_reused  hits that copied a snapshot (s > 0)
    prefix_tokens_recomputed     (h - s) summed: the tails, cached rows computed again for the KDA state
so prefix_dsa_hit_tokens = prefix_hit_tokens + prefix_tokens_recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.sequence import Sequence


@dataclass
class PrefixHit:
    """blocks: the shared blocks of [0, s), referenced for the sequence; snapshot_row: the snapshot at s (None
    when s = 0); kda_tokens: s; dsa_tokens: h (>= s)."""

    blocks: list[int] = field(default_factory=list)
    snapshot_row: int | None = None
    kda_tokens: int = 0
    dsa_tokens: int = 0

    @property
    def tail(self) -> int:
        """Cached tokens computed again: those between the snapshot and the DSA hit."""
        return self.dsa_tokens - self.kda_tokens


def find_prefix_hit(blocks: BlockManager, block_hashes: list[bytes]) -> PrefixHit:
    """The hit of a sequence whose first full blocks have these hashes (see the module docstring)."""
    shared, row = blocks.match_prefix(block_hashes)  # a spill may bring blocks back: look at the chain after it
    dsa_blocks = max(blocks.cached_chain_length(block_hashes), len(shared))
    return PrefixHit(shared, row, len(shared) * blocks.block_size, dsa_blocks * blocks.block_size)


class PrefixHits:
    """The scheduler's side of prefix hits: the per-kind counts, and each sequence's pending cut at its DSA hit.

    cut_at_dsa_hit False gives the rule before hits at any boundary (a hit only where a snapshot already is,
    no snapshot left at the DSA hit); benchmarks/bench_prefix_agent.py compares the two.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.cut_at_dsa_hit = True
        self.dsa_hit_tokens = 0
        self.snapshots_reused = 0
        self.tokens_recomputed = 0
        self._cuts: dict[int, int] = {}  # request id -> a position where one of its prefill chunks must end

    def expect(self, seq: Sequence, hit: PrefixHit) -> None:
        """Before the first chunk of an admitted sequence: end a chunk at its DSA hit when a tail runs up to it."""
        if self.cut_at_dsa_hit and hit.tail > 0:
            self._cuts[seq.request_id] = hit.dsa_tokens

    def count(self, hit: PrefixHit) -> None:
        """The sequence was admitted with this hit."""
        self.dsa_hit_tokens += hit.dsa_tokens
        self.snapshots_reused += hit.snapshot_row is not None
        self.tokens_recomputed += hit.tail

    def forget(self, seq: Sequence) -> None:
        """The sequence gave back its cache (finished, preempted, or not admitted after all)."""
        self._cuts.pop(seq.request_id, None)

    def chunk_end(self, seq: Sequence, end: int) -> int:
        """Where a prefill chunk from seq.num_computed that could reach `end` ends under prefix caching: at the
        sequence's pending cut if it lies inside, else at the last block boundary it crosses, else at `end`."""
        start = seq.num_computed
        cut = self._cuts.get(seq.request_id)
        if cut is not None and start < cut <= end:
            del self._cuts[seq.request_id]  # this chunk ends there: the snapshot is offered after it
            return cut
        boundary = end // self.block_size * self.block_size
        return boundary if boundary > start else end

    def stats(self) -> dict[str, int]:
        return {"prefix_dsa_hit_tokens": self.dsa_hit_tokens, "prefix_kda_snapshots_reused": self.snapshots_reused,
                "prefix_tokens_recomputed": self.tokens_recomputed}
