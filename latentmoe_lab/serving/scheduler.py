"""The scheduler: which tokens of which sequences run in the next step (docs/design.md §6.5).

Continuous batching, no prefill phase and no decode phase. One step spends a budget of
`prefill_chunk_size` tokens:

  1. decodes: every running sequence whose prompt is done feeds its last sampled token (one each);
  2. prefill chunks of running sequences whose prompt is not done, oldest first; while a waiting request
     could be admitted, each takes at most half the budget, so one long prompt cannot hold back the
     first tokens of short ones for its whole prefill;
  3. waiting sequences, oldest first, while a KDA slot, blocks and budget remain: each takes a slot,
     looks up the prefix cache, and starts its first chunk.

Chunked prefill needs nothing special here: a sequence keeps its slot between chunks, so its KDA state
and conv tail wait in the pools for the next chunk, and its DSA blocks keep the keys. With
`chunked_prefill` off, a prompt runs whole in one step (the first prefill of a step may overrun the budget).

Prefix caching: a chunk that would end past a block boundary ends AT the last boundary it crosses, so
that a KDA snapshot can be taken there (a prompt's tail shorter than a block then runs one step later).
A hit may end at any block boundary (serving/prefix_hits.py): the DSA rows are cached up to h, the KDA
snapshot nearest before it is at s; the sequence resumes at s, recomputes [s, h) into blocks of its own,
and ends a chunk AT h so that the next request with that prefix finds a snapshot there.

Batch-invariant serving (scheduler.batch_invariant, chunk_grid > 1): a chunk that stops short of the
prompt's end ends on a multiple of chunk_grid, the model's KDA chunk and DSA query block, so every
position is computed in the same chunk of the same grid whatever the budget left it; a sequence that
cannot reach a grid point this step waits for the next (serving/invariance.py).

Preemption by recompute: when a running sequence needs a block and none is free, the newest running
sequence not yet scheduled this step gives back its blocks and slot and returns to the head of the
waiting queue with prompt + generated tokens (num_computed = 0); it is recomputed when readmitted, the
prefix cache often giving most of it back. Nothing is admitted in a step that preempted.

Isolation after a failed step (the engine's bisection, docs/design.md §6.5): the step's sequences are
split into two isolation groups. A step runs ONE cohort, the ordinary sequences or one group, cohorts
taking turns (round-robin); within it the rules above hold unchanged, and admission stays first come,
first served across cohorts (a waiting head of another cohort waits for its turn). A member rejoins
the ordinary sequences once it has generated the token the failed step was computing.

Image-aware chunking, policy "features once": a request's vision features are computed at its first
chunk and kept until it ends (preemption included), so chunks may cut image spans anywhere; each chunk
takes the rows of the features for its own placeholders (Sequence.placeholders_before).

Speculative decoding (spec_tokens = K > 0; docs/design.md §12, serving/spec/slots.py): a sequence takes
K + 1 KDA slots when admitted, and a decode with d drafts charges 1 + d tokens of the budget (drafts are
cut to what the budget leaves). After the step the slot of the last accepted token becomes its slot,
blocks only rejected drafts reached are freed, and the prefix cache sees only accepted tokens: a block is
offered once num_computed (accepted tokens only) covers it, with the KDA snapshot taken from the spec slot
of the token exactly at its boundary. `forget(seq)` runs when a sequence is preempted or finished (the
engine lets its drafter forget the request).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.prefix_hits import PrefixHit, PrefixHits, find_prefix_hit
from latentmoe_lab.serving.sequence import Sequence, Status
from latentmoe_lab.serving.spec.slots import (acquire_slots, drop_rejected_blocks, keep_slot_of, release_slots,
                                              start_verify, state_slot_after)


@dataclass
class ScheduledBatch:
    """entries: (sequence, new tokens) in batch order; preempted: the sequences preempted to make room.

    emits() says, per entry, whether its chunk reaches the end of its tokens (it samples after the step).
    """

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decodes (the last sampled token and its drafts)."""
        return sum(n for seq, n in self.entries if seq.num_remaining == 1 and seq.generated_ids)

    @property
    def num_prefill_chunks(self) -> int:
        """Entries that run prompt tokens (a chunk of a prompt, or of a recompute), not a decode."""
        return sum(1 for seq, _ in self.entries if not (seq.num_remaining == 1 and seq.generated_ids))

    def emits(self) -> list[bool]:
        return [seq.num_computed + n == seq.num_tokens + len(seq.draft_ids) for seq, n in self.entries]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, prefill_chunk_size: int,
                 chunked_prefill: bool, copy_slot: Callable[[int, int], None], chunk_grid: int = 1,
                 spec_tokens: int = 0, forget: Callable[[Sequence], None] | None = None):
        self.blocks = block_manager
        self.chunk_grid = chunk_grid
        self.block_size = block_manager.block_size
        self.max_num_seqs = min(max_num_seqs, block_manager.num_slots)
        self.budget = prefill_chunk_size
        self.chunked_prefill = chunked_prefill
        self.copy_slot = copy_slot  # copy_slot(src_row, dst_row): KDA state + conv tail, every KDA layer
        self.spec_tokens = spec_tokens  # K: spare KDA slots per sequence (0: no speculative decoding)
        self.forget = forget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first, so the newest is preempted
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_hits = PrefixHits(self.block_size)  # per-kind hit counts, cuts at DSA hits
        self._next_group = 0  # isolation group ids, never reused
        self._last_cohort: int | None = None  # the cohort of the last step: the next one takes its turn

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ----------------------------------------------------------------- a step
    def schedule(self) -> ScheduledBatch:
        """The next step: sequences of one cohort only, the ordinary ones or one isolation group, cohorts
        taking turns so that none starves; a cohort with nothing to run passes its turn on."""
        batch = ScheduledBatch()
        scheduled: set[int] = set()
        for cohort in self._turn_order():
            self._schedule_cohort(cohort, batch, scheduled)
            if batch.entries:
                self._last_cohort = cohort
                break
        return batch

    def _schedule_cohort(self, cohort: int | None, batch: ScheduledBatch, scheduled: set[int]) -> None:
        budget = self.budget
        members = [seq for seq in self.running if seq.isolation_group == cohort]
        for seq in members:  # 1. decodes
            if seq.status is Status.RUNNING and not seq.in_prefill and budget > 0:
                # the drafts the budget and the free blocks leave room for: nobody is preempted for a guess
                room = (len(seq.block_table) + self.blocks.num_free_blocks) * self.block_size - seq.num_computed
                del seq.draft_ids[max(0, min(budget, room) - 1):]
                if self._make_room(seq, 1 + len(seq.draft_ids), scheduled, batch):
                    batch.entries.append((seq, 1 + len(seq.draft_ids)))
                    scheduled.add(seq.request_id)
                    budget -= 1 + len(seq.draft_ids)
                    if seq.draft_ids:
                        start_verify(seq)
        first_prefill = True
        # a long prompt may not take a whole step's budget while a newcomer could be admitted: half stays free
        admitting = self._admits_next(cohort) and len(self.running) < self.max_num_seqs
        share = max(1, self.budget // 2) if admitting else self.budget
        for seq in members:  # 2. prefill chunks of running sequences
            if seq.status is Status.RUNNING and seq.in_prefill and seq.request_id not in scheduled:
                n = self._chunk_length(seq, min(budget, share), first_prefill)
                if n > 0 and self._make_room(seq, n, scheduled, batch):
                    batch.entries.append((seq, n))
                    scheduled.add(seq.request_id)
                    budget -= n
                    first_prefill = False
        # 3. admit, first come first served across cohorts: a head of another cohort waits for its turn
        while self._admits_next(cohort) and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget, first_prefill)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.entries.append((seq, n))
            scheduled.add(seq.request_id)
            budget -= n
            first_prefill = False

    def _admits_next(self, cohort: int | None) -> bool:
        return bool(self.waiting) and self.waiting[0].isolation_group == cohort

    def _turn_order(self) -> list[int | None]:
        """The cohorts with unfinished sequences, beginning after the one that ran last: the ordinary
        sequences (None) rank first, isolation groups after them by id (newer groups last)."""
        def rank(cohort: int | None) -> int:
            return -1 if cohort is None else cohort

        cohorts = sorted({seq.isolation_group for seq in (*self.running, *self.waiting)}, key=rank)
        later = [c for c in cohorts if rank(c) > rank(self._last_cohort)]
        return later + [c for c in cohorts if rank(c) <= rank(self._last_cohort)]

    def isolate(self, seqs: list[Sequence]) -> None:
        """After a failed step of `seqs`, none of them to blame yet: split them into two isolation groups
        (halves in batch order; a lone sequence gets a group of its own). A member runs only in steps with
        its group until it has generated the token the failed step was computing; then it rejoins the
        ordinary sequences. A group whose step fails again is split again (docs/design.md §6.5)."""
        half = -(-len(seqs) // 2)
        for part in (seqs[:half], seqs[half:]):
            if not part:
                continue
            group, self._next_group = self._next_group, self._next_group + 1
            for seq in part:
                seq.isolation_group = group
                seq.isolated_until = len(seq.generated_ids)

    def _chunk_length(self, seq: Sequence, budget: int, first_prefill: bool) -> int:
        """New tokens for a prefilling sequence: budget-bound, block-aligned when prefix caching is on."""
        left = self._prefill_left(seq)
        if not self.chunked_prefill:
            return left if left <= budget or first_prefill else 0
        n = min(left, budget)
        if self.blocks.enable_prefix_caching:  # end where a KDA snapshot is worth taking
            n = self.prefix_hits.chunk_end(seq, seq.num_computed + n) - seq.num_computed
        return self._on_grid(seq, n)

    def _on_grid(self, seq: Sequence, n: int) -> int:
        """n, or less so that a chunk short of the prompt's end ends on the chunk grid (0 if none is in reach)."""
        if self.chunk_grid == 1 or n >= self._prefill_left(seq):
            return n
        return max(0, (seq.num_computed + n) // self.chunk_grid * self.chunk_grid - seq.num_computed)

    def _holds_last(self, seq: Sequence) -> bool:
        """Speculating: the last token runs as a verify step with drafts, never at the end of a prefill chunk,
        so a sampled token's draws do not depend on where chunks, preemptions or prefix hits fell."""
        return self.spec_tokens > 0 and seq.max_tokens > 0

    def _prefill_left(self, seq: Sequence) -> int:
        """Tokens prefill chunks may still take: all remaining ones, or all but the last (_holds_last)."""
        return seq.num_remaining - (1 if self._holds_last(seq) and seq.num_remaining > 1 else 0)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.block_size) - len(seq.block_table))

    def _make_room(self, seq: Sequence, n: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for n more tokens, preempting newer unscheduled sequences; False if seq itself went."""
        while self._blocks_needed(seq, n) > self.blocks.num_free_blocks:
            victim = next(s for s in reversed(self.running) if s.request_id not in scheduled)
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table += self.blocks.allocate_blocks(self._blocks_needed(seq, n))
        return True

    def _admit(self, seq: Sequence, budget: int, first_prefill: bool) -> int:
        """Slot, prefix hit and blocks for a waiting sequence's first chunk; its length, or 0 (left waiting)."""
        if budget <= 0 and (self.chunked_prefill or not first_prefill):
            return 0
        slots = acquire_slots(self.blocks, 1 + self.spec_tokens)
        if slots is None:
            return 0
        seq.slot, seq.spare_slots = slots[0], slots[1:]
        slot = seq.slot
        # at least one token must run to produce logits, so the last token never comes from the cache
        hit = PrefixHit()
        if self.blocks.enable_prefix_caching and not seq.needs_prompt_logits:  # those positions must run
            full_blocks = (seq.num_tokens - 1 - self._holds_last(seq)) // self.block_size
            hit = find_prefix_hit(self.blocks, seq.block_hashes(full_blocks, self.block_size))
        if hit.blocks:  # resume at the snapshot; a tail up to the DSA hit runs like prompt tokens
            self.copy_slot(hit.snapshot_row, slot)
            seq.block_table = list(hit.blocks)
            seq.num_registered = len(hit.blocks)
            seq.num_computed = hit.kda_tokens
        if self.chunked_prefill:
            self.prefix_hits.expect(seq, hit)
        n = self._chunk_length(seq, budget, first_prefill)
        if n > 0 and not self.chunked_prefill and self._blocks_needed(seq, n) > self.blocks.num_free_blocks:
            n = 0
        if n > 0 and self.chunked_prefill:
            room = (len(seq.block_table) + self.blocks.num_free_blocks) * self.block_size - seq.num_computed
            n = self._on_grid(seq, min(n, room))
        if n <= 0:
            self._release(seq)
            seq.num_computed = seq.num_registered = 0
            return 0
        seq.block_table += self.blocks.allocate_blocks(self._blocks_needed(seq, n))
        seq.status = Status.RUNNING
        seq.prefix_hit_tokens += hit.kda_tokens
        self.prefix_hit_tokens += hit.kda_tokens
        self.prefix_hits.count(hit)
        return n

    # ------------------------------------------------------------ after a step
    def finish_step(self, batch: ScheduledBatch, sampled: dict[int, list[int]]) -> None:
        """Advance each scheduled sequence; `sampled` maps request id -> its emitted tokens (one, or after a
        verify step the accepted drafts and one more, already cut at a stop token or max_tokens).

        The caller appends nothing: this records the tokens, checks the stop rules, offers newly full
        blocks to the prefix cache (with a KDA snapshot at the new end when it is block-aligned), and
        frees a finished sequence's blocks and slot.
        """
        for seq, n in batch.entries:
            if seq.status is not Status.RUNNING:
                continue  # finished with an error during the step
            old, tokens = seq.num_computed, sampled.get(seq.request_id, [])
            if seq.verify_slots:  # the last token and the accepted drafts are in; the rest is rejected
                if not tokens:
                    raise RuntimeError(f"finish_step: request {seq.request_id} verified drafts but emitted nothing")
                seq.num_computed += len(tokens)
                keep_slot_of(seq, len(tokens) - 1)
                drop_rejected_blocks(self.blocks, seq)
            else:
                seq.num_computed += n
            seq.token_ids += tokens
            self._offer_blocks(seq, old)
            seq.draft_ids, seq.verify_slots = [], []
            if tokens:
                if seq.isolation_group is not None and len(seq.generated_ids) > seq.isolated_until:
                    seq.isolation_group = None  # it got through the step that failed: back with the others
                if seq.finish_reason is None:
                    seq.finish_reason = self._stop_reason(seq)
                if seq.finish_reason is not None:
                    self.finish(seq, seq.finish_reason)
            elif seq.max_tokens == 0 and seq.num_computed == seq.num_tokens:
                self.finish(seq, "length")  # a prompt-only request (its prompt logprobs): done once it ran

    def _offer_blocks(self, seq: Sequence, old_computed: int) -> None:
        if not self.blocks.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        hashes = seq.block_hashes(full, self.block_size)
        for index in range(seq.num_registered, full):
            self.blocks.register_block(hashes[index], seq.block_table[index])
        seq.num_registered = full
        source = state_slot_after(seq, old_computed, full * self.block_size)  # None: no state at that length
        if source is not None:
            row = self.blocks.snapshot_row_for(hashes[-1])
            if row is not None:
                self.copy_slot(source, row)

    def _stop_reason(self, seq: Sequence) -> str | None:
        if seq.token_ids[-1] in seq.params.stop_token_ids:
            return "stop"
        if len(seq.generated_ids) >= seq.max_tokens:
            return "length"
        return None

    # ----------------------------------------------------- leaving the running
    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        if self.forget is not None:
            self.forget(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (done, aborted or failed): it leaves the queues and gives back its cache."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if self.forget is not None:
            self.forget(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release_blocks(seq.block_table)
        seq.block_table = []
        self.prefix_hits.forget(seq)
        release_slots(self.blocks, seq)
        seq.status = Status.WAITING
