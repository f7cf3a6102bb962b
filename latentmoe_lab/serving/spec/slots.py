"""Spec-slot bookkeeping: the K + 1 KDA slots of a speculating sequence (docs/design.md §12).

With speculative decoding every running sequence holds K + 1 slots: `seq.slot`, where its next step
starts, and K spares. A verify step over its last token and d drafts (d <= K) writes the state and conv
tail after token t into verify_slots[t] = ([slot] + spares)[t]. When j drafts are accepted the state after
the last accepted token is in verify_slots[j]: that slot becomes `seq.slot` and the others the spares.
Rejection is thus a choice of slot, never a copy, and nothing is ever written back.

    before   slot=A  spares=[B, C, D]      verify x0 d1 d2 d3 -> states after x0 in A, d1 in B, d2 in C, d3 in D
    j = 2    slot=C  spares=[A, B, D]      (the next step starts from the state after d2)

DSA rows of rejected drafts stay in their blocks, past num_computed, where nothing reads them and the next
tokens overwrite them; a block that only rejected drafts reached goes back to the free list at once.
"""
from __future__ import annotations

from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.sequence import Sequence


def acquire_slots(blocks: BlockManager, count: int) -> list[int] | None:
    """`count` running slots, or None (and nothing held) when fewer are free."""
    taken = []
    for _ in range(count):
        slot = blocks.acquire_slot()
        if slot is None:
            for held in taken:
                blocks.release_slot(held)
            return None
        taken.append(slot)
    return taken


def start_verify(seq: Sequence) -> None:
    """The slots of this step's verify: its current slot, then one spare per draft."""
    if len(seq.draft_ids) > len(seq.spare_slots):
        raise RuntimeError(f"request {seq.request_id}: {len(seq.draft_ids)} drafts but {len(seq.spare_slots)} "
                           "spare slots")
    seq.verify_slots = [seq.slot] + seq.spare_slots[:len(seq.draft_ids)]


def keep_slot_of(seq: Sequence, accepted: int) -> None:
    """After a verify step with `accepted` drafts kept: the slot holding the state after the last kept token
    becomes the sequence's slot, the others its spares (no state moves)."""
    chosen = seq.verify_slots[accepted]
    held = [seq.slot] + seq.spare_slots
    seq.slot, seq.spare_slots = chosen, [s for s in held if s != chosen]


def state_slot_after(seq: Sequence, old_computed: int, length: int) -> int | None:
    """The slot holding the state after the first `length` tokens, if this step left it anywhere: the
    sequence's slot at its new end; inside a verify step, the spec slot of the token at `length`."""
    if length == seq.num_computed:
        return seq.slot
    if seq.verify_slots and old_computed < length < seq.num_computed:
        return seq.verify_slots[length - 1 - old_computed]
    return None


def drop_rejected_blocks(blocks: BlockManager, seq: Sequence) -> None:
    """Give back the blocks past num_computed: only rejected drafts were written there (refcount 1, never
    registered: only full blocks below num_computed are offered to the prefix cache)."""
    keep = -(-seq.num_computed // blocks.block_size)
    if len(seq.block_table) > keep:
        blocks.release_blocks(seq.block_table[keep:])
        del seq.block_table[keep:]


def release_slots(blocks: BlockManager, seq: Sequence) -> None:
    """Every slot the sequence holds back to the free list."""
    for slot in ([] if seq.slot is None else [seq.slot]) + seq.spare_slots:
        blocks.release_slot(slot)
    seq.slot, seq.spare_slots, seq.verify_slots = None, [], []
