"""ForwardBatch: what one serving step hands the model (docs/design.md §6.4).

It lives beside cache.py, below the layers, because the layers take it as an argument; serving/ builds it.

The scheduler packs the new tokens of S sequences back to back into one row. Each sequence
continues from `context_len` tokens already in the paged pools (latentmoe_lab/paged_pools.py):

    input_ids      [1, total]      new tokens of sequence 0, then sequence 1, ...
    positions      [total]         absolute position of each new token in its own sequence (context_len + i)
    query_start    [S + 1]         sequence i's new tokens are input_ids[0, query_start[i]:query_start[i + 1]]
    context_len    [S]             tokens of sequence i already cached before this step
    state_slot     [S]             KDA slot (row of the state / conv pools) owned by sequence i
    block_table    [S, max_blocks] block ids of sequence i, in order; -1 past its last block
    slot_mapping   [total]         flat pool position (block_id * block_size + offset) each new token is written to
    emit           [S] bool        whether sequence i samples a token after this step (its prompt is complete)
    block_size     int             tokens per block (the pools' block_size)
    image_features [M, hidden] | None   vision features (model.encode_images) for the image placeholders
                                   among this step's tokens, in token order; None: every id keeps its embedding
    image_mask     [total] bool | None  which new tokens take image_features (M of them, in order). None with
                                   features given means every token whose id is the image placeholder id. Pass
                                   it when a generated token may equal that id (it must keep its embedding).
    decode         [S] bool | None which one-token sequences advance as decodes (KDA's recurrent step, DSA's
                                   batched decode); the rest, prompt chunks of any length, take the
                                   chunked forms. None: every one-token sequence (the runner passes it, so
                                   that a prompt's last token after a prefix hit sums as in a whole prompt)
    logits_index   [R] | None      flat indices of the new tokens whose logits the model returns, in order;
                                   None: each sequence's last new token (last_token_index, R = S). The engine
                                   adds prompt positions of requests that asked for prompt logprobs
                                   and the draft positions of speculating sequences
    spec_slots     [S, W] | None   speculative verify (docs/design.md §12): row i of a verifying sequence lists
                                   the KDA slot that receives the state and conv tail after EACH of its n_i new
                                   tokens (column 0 is its state_slot, the step starts from there; -1 past n_i);
                                   a row of -1 is an ordinary sequence. The engine then keeps the slot of the
                                   last accepted token: rejection is a slot choice, never a copy
    hidden_index   [H] | None      flat indices of the new tokens whose last hidden state (before the final
                                   norm) the model returns as .hidden [H, hidden] (the MTP drafter's input)

All index tensors are int64 on the model's device. Every sequence has at least one new token. The model
returns logits [R, vocab] fp32 at output_index: one row per sequence at its last new token unless
logits_index says otherwise (see LatentMoEForCausalLM.forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start: torch.Tensor
    context_len: torch.Tensor
    state_slot: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    emit: torch.Tensor
    block_size: int
    image_features: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None
    decode: torch.Tensor | None = None
    logits_index: torch.Tensor | None = None
    spec_slots: torch.Tensor | None = None
    hidden_index: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_len.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def query_len(self) -> torch.Tensor:
        """[S]: new tokens per sequence."""
        return self.query_start[1:] - self.query_start[:-1]

    def decode_indices(self) -> list[int]:
        """The sequences that advance as decodes: one new token and `decode` (default True)."""
        flags = [True] * self.num_seqs if self.decode is None else self.decode.tolist()
        verifying = set(self.verify_indices())
        return [i for i, (n, flag) in enumerate(zip(self.query_len.tolist(), flags))
                if n == 1 and flag and i not in verifying]

    def chunk_indices(self) -> list[int]:
        """The other sequences: prompt chunks (of any length) and verify steps, each run through the chunked
        forms by DSA (KDA runs verify steps token by token, see verify_indices)."""
        decodes = set(self.decode_indices())
        return [i for i in range(self.num_seqs) if i not in decodes]

    def verify_indices(self) -> list[int]:
        """The speculating sequences (spec_slots row not -1): KDA keeps the state after each of their tokens."""
        if self.spec_slots is None:
            return []
        return (self.spec_slots[:, 0] >= 0).nonzero().flatten().tolist()

    @property
    def last_token_index(self) -> torch.Tensor:
        """[S]: index into the flat new tokens of each sequence's last new token (its logits sample)."""
        return self.query_start[1:] - 1

    @property
    def output_index(self) -> torch.Tensor:
        """[R]: the flat new tokens whose logits the model returns (logits_index, else last_token_index)."""
        return self.last_token_index if self.logits_index is None else self.logits_index

    @classmethod
    def from_sequences(cls, new_tokens: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
                       state_slots: list[int], block_size: int, emit: list[bool] | None = None,
                       image_features: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                       device=None) -> "ForwardBatch":
        """Build a batch from plain per-sequence lists; positions and slot_mapping follow from the block tables.

        new_tokens[i]: sequence i's new token ids; block_tables[i]: its block ids (covering at least
        context_lens[i] + len(new_tokens[i]) tokens). emit defaults to True for every sequence.
        """
        if not new_tokens or any(len(t) == 0 for t in new_tokens):
            raise ValueError("new_tokens: needs at least one sequence, each with at least one new token")
        count = len(new_tokens)
        for name, values in (("context_lens", context_lens), ("block_tables", block_tables),
                             ("state_slots", state_slots)):
            if len(values) != count:
                raise ValueError(f"{name}: has {len(values)} entries for {count} sequences")
        emit = [True] * count if emit is None else list(emit)
        if len(emit) != count:
            raise ValueError(f"emit: has {len(emit)} entries for {count} sequences")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        lengths = [len(t) for t in new_tokens]
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, lengths)])
        owner = torch.repeat_interleave(torch.arange(count), torch.tensor(lengths))
        width = max(1, max(len(t) for t in block_tables))
        table = torch.full((count, width), -1, dtype=torch.long)
        for i, blocks in enumerate(block_tables):
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        needed = max(p // block_size for p in positions.tolist()) + 1
        if needed > width:
            raise ValueError(f"block_tables: too short for the positions (need {needed} blocks, have {width})")
        block_of = table[owner, positions // block_size]
        if bool((block_of < 0).any()):
            raise ValueError("block_tables: a sequence has fewer blocks than its context + new tokens need")
        slot_mapping = block_of * block_size + positions % block_size
        query_start = torch.tensor([0] + lengths).cumsum(0)
        move = (lambda t: t) if device is None else (lambda t: None if t is None else t.to(device))
        return cls(input_ids=move(torch.tensor([tok for t in new_tokens for tok in t], dtype=torch.long)[None]),
                   positions=move(positions), query_start=move(query_start),
                   context_len=move(torch.tensor(context_lens, dtype=torch.long)),
                   state_slot=move(torch.tensor(state_slots, dtype=torch.long)), block_table=move(table),
                   slot_mapping=move(slot_mapping), emit=move(torch.tensor(emit, dtype=torch.bool)),
                   block_size=block_size, image_features=move(image_features), image_mask=move(image_mask))

    def check(self, num_blocks: int, num_slots: int, max_positions: int) -> None:
        """Raise ValueError naming the field unless the batch is consistent with pools of this size.

        Catches what would otherwise corrupt the cache silently: a slot_mapping that disagrees with the
        block table, two tokens written to one position, two sequences sharing a KDA slot.
        """
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"batch.block_size: must be a positive int, got {self.block_size!r}")
        index_fields = ("positions", "query_start", "context_len", "state_slot", "block_table", "slot_mapping")
        for name in index_fields:
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
                raise TypeError(f"batch.{name}: expected an int64 tensor, got {getattr(value, 'dtype', type(value))}")
        if not isinstance(self.input_ids, torch.Tensor) or self.input_ids.dtype != torch.int64:
            raise TypeError("batch.input_ids: expected an int64 tensor [1, total]")
        if not isinstance(self.emit, torch.Tensor) or self.emit.dtype != torch.bool:
            raise TypeError("batch.emit: expected a bool tensor [S]")
        if self.decode is not None and (not isinstance(self.decode, torch.Tensor) or self.decode.dtype != torch.bool):
            raise TypeError("batch.decode: expected a bool tensor [S] or None")
        seqs, total = self.context_len.shape[0], self.input_ids.shape[-1]
        shapes = {"input_ids": (1, total), "positions": (total,), "query_start": (seqs + 1,), "context_len": (seqs,),
                  "state_slot": (seqs,), "slot_mapping": (total,), "emit": (seqs,)}
        if self.decode is not None:
            shapes["decode"] = (seqs,)
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"batch.{name}: expected shape {shape}, got {tuple(getattr(self, name).shape)}")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != seqs:
            raise ValueError(f"batch.block_table: expected shape [S={seqs}, max_blocks], "
                             f"got {tuple(self.block_table.shape)}")
        if seqs == 0 or int(self.query_start[0]) != 0 or int(self.query_start[-1]) != total \
                or bool((self.query_len < 1).any()):
            raise ValueError("batch.query_start: must start at 0, end at the token count and give every "
                             f"sequence at least one new token, got {self.query_start.tolist()}")
        if bool((self.context_len < 0).any()):
            raise ValueError("batch.context_len: must be >= 0")
        if self.logits_index is not None and (
                not isinstance(self.logits_index, torch.Tensor) or self.logits_index.dtype != torch.int64
                or self.logits_index.dim() != 1 or bool(((self.logits_index < 0) | (self.logits_index >= total)).any())):
            raise ValueError(f"batch.logits_index: expected int64 indices [R] into the {total} new tokens")
        self._check_spec_slots(num_slots)
        for name in ("hidden_index",):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.Tensor) or value.dtype != torch.int64
                                      or value.dim() != 1 or bool(((value < 0) | (value >= total)).any())):
                raise ValueError(f"batch.{name}: expected int64 indices [H] into the {total} new tokens")
        owner = torch.repeat_interleave(torch.arange(seqs, device=self.positions.device), self.query_len)
        within = torch.arange(total, device=self.positions.device) - self.query_start[owner]
        if not torch.equal(self.positions, self.context_len[owner] + within):
            raise ValueError("batch.positions: must be context_len + 0, 1, ... for each sequence's new tokens")
        if int(self.positions.max()) >= max_positions:
            raise ValueError(f"batch.positions: reach {int(self.positions.max())}, past max_position_embeddings "
                             f"({max_positions})")
        if bool((self.state_slot < 0).any()) or bool((self.state_slot >= num_slots).any()) \
                or self.state_slot.unique().numel() != seqs:
            raise ValueError(f"batch.state_slot: must be distinct slot ids in [0, num_slots={num_slots}), "
                             f"got {self.state_slot.tolist()}")
        if bool((self.block_table < -1).any()) or bool((self.block_table >= num_blocks).any()):
            raise ValueError(f"batch.block_table: entries must be block ids in [0, num_blocks={num_blocks}) or -1")
        column = self.positions // self.block_size
        if int(column.max()) >= self.block_table.shape[1]:
            raise ValueError("batch.block_table: has fewer columns than the positions need")
        block_of = self.block_table[owner, column]
        if bool((block_of < 0).any()):
            raise ValueError("batch.block_table: a sequence has no block (-1) where its new tokens go")
        if not torch.equal(self.slot_mapping, block_of * self.block_size + self.positions % self.block_size):
            raise ValueError("batch.slot_mapping: must equal block_table[seq, pos // block_size] * block_size "
                             "+ pos % block_size for every new token")
        if self.slot_mapping.unique().numel() != total:
            raise ValueError("batch.slot_mapping: two new tokens are written to the same pool position")
        # Every cached position must also have a block (the DSA layers read them all through the table).
        last_column = (self.context_len + self.query_len - 1) // self.block_size
        known = torch.arange(self.block_table.shape[1], device=self.block_table.device) <= last_column[:, None]
        if bool(((self.block_table < 0) & known).any()):
            raise ValueError("batch.block_table: a sequence lacks a block for part of its cached context")

    def _check_spec_slots(self, num_slots: int) -> None:
        """spec_slots: -1 rows, or column 0 == state_slot, then distinct slots for the other new tokens,
        -1 past them; no slot written twice in the step (two verify rows, or one and another's state_slot)."""
        spec = self.spec_slots
        if spec is None:
            return
        seqs = self.context_len.shape[0]
        if not isinstance(spec, torch.Tensor) or spec.dtype != torch.int64 or spec.dim() != 2 \
                or spec.shape[0] != seqs or spec.shape[1] < 1:
            raise ValueError(f"batch.spec_slots: expected an int64 tensor [S={seqs}, W], got "
                             f"{getattr(spec, 'dtype', type(spec))} {tuple(getattr(spec, 'shape', ()))}")
        if bool((spec < -1).any()) or bool((spec >= num_slots).any()):
            raise ValueError(f"batch.spec_slots: entries must be slot ids in [0, num_slots={num_slots}) or -1")
        width = torch.arange(spec.shape[1], device=spec.device)
        written = []
        for i in self.verify_indices():
            n = int(self.query_len[i])
            row = spec[i]
            if n < 2 or n > spec.shape[1] or bool((row[:n] < 0).any()) or bool((row[n:] >= 0).any()) \
                    or int(row[0]) != int(self.state_slot[i]):
                raise ValueError(f"batch.spec_slots: row {i} must hold state_slot ({int(self.state_slot[i])}) and "
                                 f"then one slot for each of its other {n - 1} new tokens (n >= 2), -1 after, "
                                 f"got {row.tolist()}")
            written.append(row[width < n])
        if written:
            others = [self.state_slot[i:i + 1] for i in range(seqs) if i not in set(self.verify_indices())]
            every = torch.cat(written + others)
            if every.unique().numel() != every.numel():
                raise ValueError("batch.spec_slots: a KDA slot is written twice in the step (shared by two "
                                 "verify rows, or also another sequence's state_slot)")

    def checked_image_mask(self, image_token_id: int | None, hidden_size: int) -> torch.Tensor:
        """The [total] bool mask of the new tokens that take image_features, after checking both fields.

        image_token_id None: the model has no vision tower, so no features are accepted.
        """
        features, mask = self.image_features, self.image_mask
        if features is None:
            raise ValueError("batch.image_mask: given without batch.image_features")
        if image_token_id is None:
            raise ValueError("batch.image_features: this model has no vision tower (config.vision is None)")
        if not isinstance(features, torch.Tensor) or not features.is_floating_point() or features.dim() != 2 \
                or features.shape[1] != hidden_size:
            raise ValueError(f"batch.image_features: expected a floating tensor [M, hidden={hidden_size}], got "
                             f"{tuple(features.shape) if isinstance(features, torch.Tensor) else type(features)}")
        placeholders = self.input_ids[0] == image_token_id
        if mask is None:
            mask = placeholders
        elif not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (self.num_tokens,):
            raise ValueError(f"batch.image_mask: expected a bool tensor [total={self.num_tokens}]")
        elif bool((mask & ~placeholders).any()):
            raise ValueError(f"batch.image_mask: marks a token that is not the image placeholder id {image_token_id}")
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(f"batch.image_features: has {features.shape[0]} rows for {int(mask.sum())} image "
                             "placeholder tokens in this step (pass image_mask when some placeholders take none)")
        if not bool(torch.isfinite(features).all()):
            raise ValueError("batch.image_features: contains NaN or inf")
        return mask
