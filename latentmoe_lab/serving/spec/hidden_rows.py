"""The MTP drafter's first row after a cache hit: a hidden row kept beside every KDA slot row (docs/design.md §12).

The MTP drafter (mtp_batched.py) reads the target's last hidden state (before the final norm) at every
position it drafts from, and a request gets those rows from the steps that compute its tokens. Positions
that came from elsewhere, a prefix-cache hit, a spill restore or a prefill instance's transfer, were never
computed here. What travels with such a request is a KDA slot row, the state after its first s tokens; so
the row of position s - 1 is kept beside it and travels with it:

    running slot    after every forward (record): the row of the slot's last position; a verify step writes
                    the row of each of its tokens into that token's spec slot, as the KDA states go (slots.py)
    snapshot row    copied with the KDA state and conv tail (copy_slot, the scheduler's copy at a block
                    boundary): a prefix-cache entry keeps the row of the position before its boundary
    spill entry     "mtp.hidden" of a "kda" entry, host and disk (cache_tiers/spill_blocks.py), checksummed
    P/D payload     RequestCache.mtp_hidden [1, hidden] (transport/), the row of the last prompt position

A request resuming from a slot row s then starts its drafter at s - 1 (Speculator.take_restored_row): its
first DraftInput holds the tokens from position s - 1 on and the rows from s - 1 on, and the MTP depths'
attention covers positions s - 1 .. instead of 0 .. (the drafter keeps no rows from before the hit). The
drafts differ from those over the whole history, never the tokens: verification keeps greedy outputs
model.generate's, and a seeded sample never drafts with mtp (speculator.py).

Where the rows live: in the engine's process, where the drafter runs and where every runner returns the
hidden rows (the in-process pools' device, or the CPU beside worker processes), one row per KDA slot row
of the plan (running slots, then snapshot rows). A model with an MTP head keeps them whatever the engine's
speculation method, so an export from an ngram or non-speculating engine (a P/D prefill instance) carries
the row too; the planner counts them in every slot's bytes (planner.mtp_row_bytes).
"""
from __future__ import annotations

import torch

from latentmoe_lab.serving.sequence import Sequence, Status


class SlotHiddenRows:
    """rows [num_rows, hidden] in the plan's compute dtype; held[r]: row r holds a hidden row (one was written
    or copied there). read() gives a row back in the model's dtype (`out_dtype`), the drafter's."""

    def __init__(self, num_rows: int, hidden_size: int, dtype: torch.dtype, device=None,
                 out_dtype: torch.dtype | None = None):
        for name, value in (("num_rows", num_rows), ("hidden_size", hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        self.rows = torch.zeros(num_rows, hidden_size, dtype=dtype, device=device)
        self.held = [False] * num_rows
        self.out_dtype = dtype if out_dtype is None else out_dtype

    @classmethod
    def for_engine(cls, model, plan, device=None) -> SlotHiddenRows | None:
        """The rows of an engine serving `model` with `plan` (a rank's CachePlan: its KDA slot rows and compute
        dtype); None for a model without an MTP head."""
        if model.config.mtp_depth == 0:
            return None
        return cls(plan.pool_rows, model.config.hidden_size, plan.dtype, device, next(model.parameters()).dtype)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def copy(self, src: int, dst: int) -> None:
        """Row src into row dst, beside the KDA state's copy."""
        self.rows[dst] = self.rows[src]
        self.held[dst] = self.held[src]

    def read(self, row: int) -> torch.Tensor | None:
        """Row `row` [hidden] (a copy, model dtype), None where none was written."""
        return self.rows[row].to(self.out_dtype, copy=True) if self.held[row] else None

    def stored(self, row: int) -> torch.Tensor | None:
        """Row `row` [hidden] as stored (compute dtype), a CPU copy for a spill entry or a transfer; None where
        none was written."""
        return self.rows[row].to("cpu", copy=True) if self.held[row] else None

    def write(self, row: int, value: torch.Tensor | None) -> None:
        """value [hidden] into row `row`; None marks the row empty (a restored entry that had none)."""
        if value is not None:
            self.rows[row] = value.to(self.rows.device, self.rows.dtype)
        self.held[row] = value is not None

    def record(self, entries: list[tuple[Sequence, int]], hidden: torch.Tensor | None, speculator=None) -> None:
        """After a step's forward, before finish_step copies slots into snapshot rows.

        entries: the step's (sequence, new tokens); hidden [total, hidden]: every new token's row in entry
        order (the runner's output.hidden). Each running sequence's slot gets the row of its last new token;
        a verify step's spec slots the rows of their tokens (verify_slots[t] <- token t). The engine's
        Speculator, when given, first sees the row each sequence's slot holds (take_restored_row).
        """
        take_restored = speculator.take_restored_row if speculator is not None and speculator.needs_hidden else None
        if hidden is None:
            return
        slots, positions, start = [], [], 0
        for seq, n in entries:
            if seq.status is Status.RUNNING:
                if take_restored is not None:
                    take_restored(seq, self.read(seq.slot))
                targets = seq.verify_slots or [seq.slot]
                slots += targets
                positions += range(start + n - len(targets), start + n)
            start += n
        if slots:
            index = torch.tensor(positions, device=hidden.device)
            self.rows.index_copy_(0, torch.tensor(slots, device=self.rows.device),
                                  hidden.index_select(0, index).to(self.rows.device, self.rows.dtype))
            for slot in slots:
                self.held[slot] = True


def slot_copier(runner, hidden_rows: SlotHiddenRows | None):
    """The scheduler's copy_slot(src, dst): the runner's (KDA state + conv tail in the pools, wherever they
    are), and the hidden row beside it when the engine keeps them."""
    if hidden_rows is None:
        return runner.copy_slot

    def copy_slot(src: int, dst: int) -> None:
        runner.copy_slot(src, dst)
        hidden_rows.copy(src, dst)

    return copy_slot
