"""The paged (serving) side of the KDA layer: per-sequence conv tails and recurrent states in pool slots.

A serving step packs S sequences into x [1, total, hidden] (ForwardBatch); each owns one slot of the
layer's KDAPool: a conv tail [channels, kernel-1] and a state [H, d_k, d_v] fp32 (as stored: pool.conv[slot],
pool.state[slot]). Decodes (batch.decode_indices(): one generated token) of many sequences advance
together; a prompt chunk, even of one token, runs the chunked form on its own (a loop over sequences,
never over tokens). A verify step of speculative decoding (batch.spec_slots, docs/design.md §12) runs its
K + 1 tokens one recurrent step at a time and leaves the state and conv tail after each in its own slot
(`advance_verify`); the engine then keeps the slot of the last accepted token.

Two ways to advance the states, with the same math:
  - `advance_gathered`, the reference: read the S states into an owned copy, advance it, and write it
    back (two extra passes over every state);
  - `advance_in_pool`: the fused decode step (ops/kda_decode.py) runs on views of pool.state itself,
    one per run of consecutive slots, and prefills read and write their own slot row, so no state is
    copied. A decode step is memory-bound on CPU, so this removes about a third of the layer's traffic
    (benchmarks/bench_kda_paged_decode.py). tests/test_ops_kda_decode.py compares the two on ragged batches.

Every state and conv tail goes through the pool's slot formats (memory.state_dtype, quant/kda_state.py): a
read decodes to fp32, a write encodes, and a state written back continues its slot's rounding error (error
feedback). Only a format that stores fp32 values (`in_place`) is advanced where it lives; a bf16 or int8 pool
runs `advance_gathered` with the fused step on the decoded copy. A verify step reads each token's state back
from its slot before the next token, so speculating gives the states plain decodes would.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange

from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.ops.kda import kda_chunked
from latentmoe_lab.ops.kda_decode import kda_decode_step_
from latentmoe_lab.paged_pools import KDAPool

DecodeStep = Callable[..., torch.Tensor]  # (state [R, H, K, V] advanced in place, q, k, v, g, beta) -> o [R, H, V]


def short_conv_paged(qkv: torch.Tensor, batch: ForwardBatch, pool: KDAPool, weight: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv over packed qkv [1, total, channels], per sequence; tails via pool.conv.

    weight: [channels, kernel]. Each sequence's kernel-1 tail (zero when context_len is 0) is laid out before
    its new tokens in one buffer [total + S * (kernel-1), channels]; every token's window then lies inside its
    own sequence. The last kernel-1 rows of each sequence's stretch become its new tail.
    """
    channels, kernel = weight.shape
    history = kernel - 1
    seqs, total = batch.num_seqs, batch.num_tokens
    device = qkv.device
    seq_ids = torch.arange(seqs, device=device)
    owner = torch.repeat_interleave(seq_ids, batch.query_len)
    token_at = torch.arange(total, device=device) + history * (owner + 1)  # row of each new token
    steps = torch.arange(history, device=device)
    tail_at = (batch.query_start[:-1] + history * seq_ids)[:, None] + steps  # [S, kernel-1]
    tails = pool.read_conv(batch.state_slot).to(qkv.dtype)  # [S, channels, kernel-1]
    tails = tails.masked_fill((batch.context_len == 0)[:, None, None], 0.0)

    rows = qkv.new_zeros(total + seqs * history, channels)
    rows[token_at] = qkv[0]
    rows[tail_at.flatten()] = rearrange(tails, "s c j -> (s j) c")
    verifying = batch.verify_indices()
    taps = rows  # what a token's earlier taps read
    if verifying:
        spec = batch.spec_slots[verifying]  # [V, W], -1 past each row's tokens
        owner_row = torch.tensor(verifying, device=device)[:, None].expand_as(spec)
        token = batch.query_start[verifying][:, None] + torch.arange(spec.shape[1], device=device)
        written = spec >= 0
        row_of = token[written] + history * (owner_row[written] + 1)  # buffer row of each verify token
        if not pool.conv_format.in_place:  # a later token of the step meets an earlier one as a decode would:
            taps = rows.clone()  # through the tail it was stored in
            taps[row_of] = _as_stored(pool, rows[row_of])
    # Tap j meets the input history - j tokens back; products summed in fp32 (as a conv kernel accumulates).
    weight = weight.float()
    out = sum((rows if j == history else taps)[token_at - history + j].float() * weight[:, j] for j in range(kernel))

    new_tail_at = (batch.query_start[1:] + history * (seq_ids + 1) - history)[:, None] + steps
    new_tails = rearrange(rows[new_tail_at], "s j c -> s c j")
    pool.write_conv(batch.state_slot, new_tails)
    if verifying:  # the tail after EACH token of a verify step, into its spec slot (column 0 rewrites the above)
        tails_after = rearrange(rows[(row_of - history + 1)[:, None] + steps], "n j c -> n c j")
        pool.write_conv(spec[written], tails_after)
    return out.to(qkv.dtype)[None]


def _as_stored(pool: KDAPool, values: torch.Tensor) -> torch.Tensor:
    """values [N, channels] as the pool's conv format gives them back from a tail column (a write, then a
    read, of a one-column tail: a stored column keeps its bytes when the tail shifts, quant/kda_state.py)."""
    fmt, slots = pool.conv_format, torch.arange(len(values), device=values.device)
    scratch = fmt.allocate(len(values), (values.shape[1], 1), values.device)
    fmt.write(scratch, slots, values[:, :, None])
    return fmt.read(scratch, slots)[:, :, 0].to(values.dtype)


def advance_gathered(pool: KDAPool, batch: ForwardBatch, heads: tuple[torch.Tensor, ...], chunk_size: int,
                     decode_step: DecodeStep) -> torch.Tensor:
    """The reference: gather the S states once, advance the owned copy in place, scatter it back once.

    heads: q, k, g [1, total, H, d_k], v [1, total, H, d_v], beta [1, total, H] -> o [1, total, H, d_v].
    Works for every backend and with gradients (decode_step chooses the op).
    """
    q, k, v, g, beta = heads
    fresh = batch.context_len == 0  # a new sequence starts from S = 0 and no carry, whatever the slot held
    if bool(fresh.any()):
        pool.state.index_fill_(0, batch.state_slot[fresh], 0)
    state = pool.read_state(batch.state_slot)  # [S, H, d_k, d_v] fp32, an owned copy
    out = v.new_empty(v.shape)
    starts = batch.query_start.tolist()
    decodes = batch.decode_indices()
    if decodes:
        tokens = batch.query_start[decodes]  # each decode's one token
        # The scheduler puts decodes first, so their rows are usually one slice: a view, no copy.
        as_slice = decodes == list(range(decodes[0], decodes[-1] + 1))
        rows = state[decodes[0]:decodes[-1] + 1] if as_slice else state[decodes]
        out[0, tokens] = decode_step(rows, *(t[0, tokens] for t in heads))
        if not as_slice:
            state[decodes] = rows
    # With gradients the op may save its initial state for backward; `state[i] = ...` below writes that memory.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in heads)
    verifying = batch.verify_indices()
    for i in _prompt_chunks(batch, verifying):
        span = slice(starts[i], starts[i + 1])
        initial = state[i:i + 1].clone() if needs_grad else state[i:i + 1]
        o, final = kda_chunked(*(t[:, span] for t in heads), initial_state=initial, output_final_state=True,
                               chunk_size=chunk_size)
        out[:, span] = o
        state[i] = final[0]
    advanced = [i for i in range(batch.num_seqs) if i not in verifying]  # verify rows write per token below
    if len(advanced) == batch.num_seqs:
        pool.write_state(batch.state_slot, state)
    elif advanced:
        pool.write_state(batch.state_slot[advanced], state[advanced])
    if verifying:
        advance_verify(pool, batch, heads, decode_step, out, state[verifying].detach())
    return out


def advance_in_pool(pool: KDAPool, batch: ForwardBatch, heads: tuple[torch.Tensor, ...],
                    chunk_size: int) -> torch.Tensor:
    """`advance_gathered` without the copies: the states are advanced where they live, in pool.state.

    Same shapes. Forward-only (the fused step has no backward) on the torch backend; the layer checks that.
    A pool whose state format does not store fp32 values runs `advance_gathered` with the fused step instead.
    """
    if not pool.state_format.in_place:
        return advance_gathered(pool, batch, heads, chunk_size, kda_decode_step_)
    q, k, v, g, beta = heads
    state = pool.state  # [slots, H, d_k, d_v], contiguous: a slice of rows is a contiguous view
    slots = batch.state_slot.tolist()
    for i in (batch.context_len == 0).nonzero().flatten().tolist():
        state[slots[i]].zero_()  # a new sequence starts from S = 0, whatever the slot held
    out = v.new_empty(v.shape)
    starts = batch.query_start.tolist()
    decodes = batch.decode_indices()
    for first_slot, members in slot_runs([slots[i] for i in decodes], decodes):
        tokens = batch.query_start[members]
        rows = state[first_slot:first_slot + len(members)]
        out[0, tokens] = kda_decode_step_(rows, *(t[0, tokens] for t in heads))
    verifying = batch.verify_indices()
    if verifying:
        advance_verify(pool, batch, heads, kda_decode_step_, out, state.index_select(0, batch.state_slot[verifying]))
    for i in _prompt_chunks(batch, verifying):
        span, row = slice(starts[i], starts[i + 1]), state[slots[i]:slots[i] + 1]
        o, final = kda_chunked(*(t[:, span] for t in heads), initial_state=row, output_final_state=True,
                               chunk_size=chunk_size)
        out[:, span] = o
        row.copy_(final)
    return out


def advance_verify(pool: KDAPool, batch: ForwardBatch, heads: tuple[torch.Tensor, ...], decode_step: DecodeStep,
                   out: torch.Tensor, state: torch.Tensor) -> None:
    """Verify steps (batch.spec_slots): the V speculating sequences advance one token at a time, together,
    and the state after their token t goes to spec_slots[i, t]: the engine keeps the slot of the last
    accepted token, so a rejection costs no copy and the accepted states are those of plain decodes.

    state [V, H, d_k, d_v] fp32: their initial states, an owned copy (advanced in place); heads as in
    advance_gathered; out [1, total, H, d_v] gets their outputs. Token t's state continues the rounding
    error of token t - 1's slot, and a format that does not store fp32 values gives the next token the
    state read back from the slot, as a decode would start from it.
    """
    verifying = batch.verify_indices()
    spec = batch.spec_slots[verifying]  # [V, W]
    lengths = batch.query_len[verifying].tolist()
    starts = batch.query_start[verifying]
    for t in range(max(lengths)):
        active = [r for r, n in enumerate(lengths) if n > t]  # rows still holding a token t (ragged drafts)
        rows = state if len(active) == len(lengths) else state[active]
        tokens = starts[active] + t
        out[0, tokens] = decode_step(rows, *(h[0, tokens] for h in heads))
        pool.write_state(spec[active, t], rows, carry_from=spec[active, t - 1] if t else None)
        if not pool.state_format.in_place:
            rows.copy_(pool.read_state(spec[active, t]))
        if rows is not state:
            state[active] = rows


def _prompt_chunks(batch: ForwardBatch, verifying: list[int]) -> list[int]:
    """The sequences KDA runs through the chunked form: DSA's chunks less the verify steps."""
    return [i for i in batch.chunk_indices() if i not in verifying]


def slot_runs(slots: list[int], members: list[int]) -> list[tuple[int, list[int]]]:
    """Group members by runs of consecutive slots: [(first slot, members in slot order)], in slot order.

    slots[j] is the slot of members[j] (distinct slots). E.g. slots [5, 0, 1, 7], members [a, b, c, d]
    -> [(0, [b, c]), (5, [a]), (7, [d])].
    """
    runs: list[tuple[int, list[int]]] = []
    last = None
    for slot, member in sorted(zip(slots, members)):
        if last is not None and slot == last + 1:
            runs[-1][1].append(member)
        else:
            runs.append((slot, [member]))
        last = slot
    return runs
