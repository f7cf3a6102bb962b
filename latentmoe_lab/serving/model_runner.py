"""Model runner: a scheduled batch -> one ForwardBatch -> the model -> one logits row per sequence (docs/design.md §6.4).

For S scheduled sequences with n_i new tokens each, the new tokens go back to back in one row:

    input_ids    [1, total]       token_ids[num_computed : num_computed + n_i] of each sequence
    positions    [total]          num_computed + 0 .. n_i - 1
    query_start  [S + 1]          prefix sums of n_i
    context_len  [S]              num_computed (tokens already in the pools)
    state_slot   [S]              the sequence's KDA slot
    block_table  [S, max_blocks]  its block ids, -1 past the end
    slot_mapping [total]          block_table[p // block_size] * block_size + p % block_size for each position p
    emit         [S]              the chunk reaches the end of token_ids: sample after this step
    decode       [S]              one new token that is a generated one (a prompt's last token alone, after a
                                  prefix hit, runs as a one-token chunk instead)
    image_features [P, hidden]    rows of each sequence's (once-computed) vision features for the image
                                  placeholders inside its chunk, in token order; image_mask [total] marks them
    logits_index   [S + P + D] | None each sequence's last new token, then the P prompt positions whose
                                  logits requests with prompt_logprobs still need (prompt_logit_positions),
                                  then the other positions of verify steps (verify_logit_rows); None if P + D = 0
    spec_slots     [S, K + 1] | None  speculating sequences: seq.verify_slots, the slot receiving the KDA state
                                  after each of its tokens; -1 rows for the others (None: nobody verifies)
    hidden_index   [total] | None with return_hidden (the MTP drafter): every new token's hidden state

The model returns logits [S + P + D, vocab]: row i at sequence i's last new token, then the prompt
positions, then the verify positions.

The runner owns the paged pools: the engine, a prefill/decode transfer, the prefix-cache spill and the
host tier's counters reach them through read_rows / write_rows / copy_slot / offload_stats only, the same
interface ParallelRunner (serving/workers/) offers over its worker processes' pools.
"""
from __future__ import annotations

import contextlib
import time

import torch

from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.ops.batch_invariant import batch_invariant_mode
from latentmoe_lab.parallel.eplb.load import moe_layers
from latentmoe_lab.serving.cache_tiers.offload_tier import offload_counters
from latentmoe_lab.serving.logprobs import token_logprobs
from latentmoe_lab.serving.planner import CachePlan, allocate_pools
from latentmoe_lab.serving.scheduler import ScheduledBatch
from latentmoe_lab.serving.sequence import Sequence
from latentmoe_lab.serving.transport.pool_rows import read_request_rows, write_request_rows


class LocalPools:
    """PagedPools in this process and the row interface over them (see the module docstring's last paragraph)."""

    restarts = 0  # worker group restarts (ParallelRunner); pools in this process are never lost

    def __init__(self, pools):
        self.pools = pools

    def read_rows(self, positions: torch.Tensor, slot: int | None) -> dict[str, torch.Tensor]:
        """A request's rows in the whole-model layout a transfer carries (transport/pool_rows.py): its tokens at
        flat positions [N] in every DSA layer, KDA slot `slot` in every KDA layer (None: no KDA rows)."""
        return read_request_rows(self.pools, positions, slot)

    def write_rows(self, positions: torch.Tensor, slot: int | None, rows: dict[str, torch.Tensor]) -> None:
        """Store whole-model rows (read_rows' layout) at flat positions [N] and KDA slot `slot`."""
        write_request_rows(self.pools, positions, slot, rows)

    def copy_slot(self, src: int, dst: int) -> None:
        """KDA state + conv tail of slot src into slot dst, every KDA layer (prefix snapshots and hits)."""
        self.pools.copy_slot(src, dst)

    def offload_stats(self) -> dict[str, int]:
        """memory.offload's counters {"offload_*": int} for Engine.stats(); {} without a host tier."""
        return offload_counters([self.pools.stats()]) if self.pools.offloaded else {}


class ModelRunner(LocalPools):
    eplb_bytes_moved = 0  # expert weights EPLB migrated between ranks (ParallelRunner)

    def __init__(self, model, plan: CachePlan, device: torch.device | str = "cpu", batch_invariant: bool = False,
                 return_hidden: bool = False):
        self.model = model
        self.return_hidden = return_hidden  # every new token's last hidden state on the output (MTP drafts)
        self.batch_invariant = batch_invariant  # forward inside batch_invariant_mode (serving/invariance.py)
        self.block_size = plan.block_size
        self.device = torch.device(device)
        super().__init__(self._allocate(plan))
        self.last_build_time = 0.0  # seconds the last run spent building ForwardBatch metadata

    def _allocate(self, plan: CachePlan):
        """The PagedPools of `plan` in this process (ParallelRunner: None, each worker allocates its own)."""
        return allocate_pools(self.model.config, plan, self.device)

    def worker_stats(self) -> dict:
        """The worker processes' figures for Engine.stats(): none when the forward runs in this process."""
        return {"worker_restarts": 0, "rank_forward_seconds": [], "rank_collective_seconds": [],
                "rank_resident_bytes": []}

    def unavailable_workers(self) -> list[str]:
        """Forward worker processes that are stopped or gone, described (none: the forward runs here)."""
        return []

    @torch.no_grad()
    def encode_batch_images(self, batch: ScheduledBatch) -> list[tuple[Sequence, str]]:
        """Vision features of each sequence's whole prompt, once per request (kept across chunks and preemptions),
        before the step's forward (in this process for a ParallelRunner too); -> (sequence, error) of those whose
        images fail to encode (each such request fails alone)."""
        failed = []
        for seq, _ in batch.entries:
            if seq.images is None or seq.image_features is not None:
                continue
            try:
                seq.image_features = self.model.encode_images(seq.images.pixel_values.to(self.device),
                                                              seq.images.image_grids.to(self.device))
            except ValueError as error:
                failed.append((seq, f"images: {error}"))
        return failed

    def build_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        tokens, positions, slot_mapping, starts, contexts, slots, tables, decode = [], [], [], [0], [], [], [], []
        image_rows, image_mask = [], []
        for seq, n in batch.entries:
            start = seq.num_computed
            span = range(start, start + n)
            tokens += seq.scheduled_ids[start:start + n]
            positions += span
            slot_mapping += [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                             for p in span]
            starts.append(starts[-1] + n)
            contexts.append(start)
            slots.append(seq.slot)
            decode.append(n == 1 and start >= len(seq.prompt_ids))
            tables.append(seq.block_table)
            image_mask += _placeholder_mask(seq, start, start + n)
            if seq.images is not None:
                first, last = seq.placeholders_before(start), seq.placeholders_before(start + n)
                if last > first:
                    image_rows.append(seq.image_features[first:last])
        width = max(len(t) for t in tables)
        block_table = torch.full((len(tables), width), -1, dtype=torch.int64)
        for row, table in enumerate(tables):
            block_table[row, :len(table)] = torch.tensor(table, dtype=torch.int64)

        def ids(values):
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        extra = [starts[index] + position - seq.num_computed
                 for index, seq, first, count in prompt_logit_positions(batch)
                 for position in range(first, first + count)]
        verifying = [(index, seq) for index, (seq, _) in enumerate(batch.entries) if seq.verify_slots]
        extra += [starts[index] + t for index, seq in verifying for t in range(len(seq.verify_slots) - 1)]
        spec_slots = None
        if verifying:
            width = max(len(seq.verify_slots) for _, seq in verifying)
            spec_slots = torch.full((len(batch.entries), width), -1, dtype=torch.int64)
            for index, seq in verifying:
                spec_slots[index, :len(seq.verify_slots)] = torch.tensor(seq.verify_slots, dtype=torch.int64)
            spec_slots = spec_slots.to(self.device)
        return ForwardBatch(
            spec_slots=spec_slots, hidden_index=ids(list(range(starts[-1]))) if self.return_hidden else None,
            logits_index=ids([s - 1 for s in starts[1:]] + extra) if extra else None,
            input_ids=ids(tokens)[None], positions=ids(positions), query_start=ids(starts),
            context_len=ids(contexts), state_slot=ids(slots), block_table=block_table.to(self.device),
            slot_mapping=ids(slot_mapping),
            emit=torch.tensor(batch.emits(), dtype=torch.bool, device=self.device),
            decode=torch.tensor(decode, dtype=torch.bool, device=self.device),
            block_size=self.block_size,
            image_features=torch.cat(image_rows) if image_rows else None,
            image_mask=torch.tensor(image_mask, dtype=torch.bool, device=self.device) if image_rows else None,
        )

    def expert_counts(self) -> torch.Tensor:
        """Routed tokens per logical expert of every MoE layer in the last step, [MoE layers, E] int64."""
        return torch.stack([layer.last_expert_counts for layer in moe_layers(self.model)])

    @torch.no_grad()
    def run(self, batch: ScheduledBatch):
        """Run one step (its images encoded: encode_batch_images) -> the model's output: .logits [S, vocab] fp32,
        row i for batch.entries[i]."""
        start = time.monotonic()
        forward_batch = self.build_batch(batch)
        self.last_build_time = time.monotonic() - start
        with batch_invariant_mode() if self.batch_invariant else contextlib.nullcontext():
            return self.model(forward_batch.input_ids, batch=forward_batch, pools=self.pools)


def prompt_logit_positions(batch: ScheduledBatch) -> list[tuple[int, Sequence, int, int]]:
    """(entry index, sequence, first position, count): the prompt positions of this step whose logits a
    request with prompt_logprobs has not recorded yet (position p scores prompt token p + 1)."""
    out = []
    for index, (seq, n) in enumerate(batch.entries):
        if seq.needs_prompt_logits:
            first = max(seq.num_computed, len(seq.prompt_logprobs))
            end = min(seq.num_computed + n, len(seq.prompt_ids) - 1)
            if end > first:
                out.append((index, seq, first, end - first))
    return out


def verify_logit_rows(batch: ScheduledBatch) -> dict[int, list[int]]:
    """entry index -> the logits rows of its verify step, in token order (its K + 1 positions: the extra rows
    after the S sampling rows and the prompt rows, then its own sampling row last)."""
    row = len(batch.entries) + sum(count for *_, count in prompt_logit_positions(batch))
    rows = {}
    for index, (seq, _) in enumerate(batch.entries):
        if seq.verify_slots:
            drafts = len(seq.verify_slots) - 1
            rows[index] = list(range(row, row + drafts)) + [index]
            row += drafts
    return rows


def record_prompt_logprobs(batch: ScheduledBatch, prompt_rows: torch.Tensor) -> None:
    """prompt_rows [P, vocab]: the logits rows past the S sampling rows, in prompt_logit_positions order;
    appends each sequence's prompt logprobs (position p scores prompt token p + 1)."""
    row = 0
    for _, seq, first, count in prompt_logit_positions(batch):
        targets = seq.prompt_ids[first + 1:first + 1 + count]
        seq.prompt_logprobs += token_logprobs(prompt_rows[row:row + count], targets, seq.params.prompt_logprobs)
        row += count


def _placeholder_mask(seq: Sequence, start: int, end: int) -> list[bool]:
    """For positions [start, end): True where the prompt holds an image placeholder (generated ids never do)."""
    mask = [False] * (end - start)
    if seq.images is not None:
        for span_start, span_end in seq.images.spans:
            for p in range(max(start, span_start), min(end, span_end)):
                mask[p - start] = True
    return mask
