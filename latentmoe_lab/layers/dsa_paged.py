"""The paged (serving) side of Gated DSA: attention over a DSAPool read through each sequence's block table.

A serving step packs S sequences into x [1, total, hidden] (ForwardBatch). forward_paged writes the new
[c_kv | k_rope] rows and index keys to the pool at batch.slot_mapping, then every query scores its own
sequence's keys (context_len + its new tokens), takes the indexer's top-k and attends in absorbed form:
the selection the contiguous cache makes (layers/dsa.py). Decodes of many sequences run batched, grouped by
decode_groups so one long context does not pad the short ones; so do the short verify steps of speculative
decoding under "blocks" (batched_verify_groups); each prefill chunk runs on its own.

Two ways to read the pool, with the same selection (GatedDSA.paged_reads):
  "blocks" - scores tiles of key_block queries x key_block keys with a running top-k and gathers only the
             selected latent rows (ops/paged_sparse.py): temporaries flat in chunk and context length;
  "gather" - the reference twin: copies each sequence's context out (sequence_positions,
             gather_left_padded) and runs the contiguous path's index_topk / sparse_attention on it.
With a host tier (a pool whose `offloaded` is set: serving/cache_tiers/offload_tier.py, docs/design.md §15.1)
"blocks" decodes read selected rows through each sequence's hot buffer. tests/test_paged_dsa_blockwise.py
compares the two on ragged batches.
"""
from __future__ import annotations

from functools import partial

import torch
from einops import einsum
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.ops.paged_sparse import paged_dense_attention, paged_index_topk, paged_sparse_attention
from latentmoe_lab.paged_pools import DSAPool


def forward_paged(layer: nn.Module, x: torch.Tensor, batch: ForwardBatch | None, pool: DSAPool | None,
                  cache, absorb, dense, sequence_start) -> torch.Tensor:
    """x [1, total, hidden] of batch's S sequences -> [1, total, hidden], through the paged pool.

    layer: the GatedDSA (layers/dsa.py) whose forward calls this; typed nn.Module because dsa.py imports this
    module, so this one may not import dsa.py. Its projections, absorbed weights and options are used.

    The new [c_kv | k_rope] and index keys go to pool positions slot_mapping first; then every query
    scores its own sequence's keys, read through the block table (context_len + its new tokens), takes
    the indexer's top-k and attends in absorbed form: the selection the contiguous cache makes. Decodes
    run batched (see decode_groups); each prefill chunk runs on its own, query_block queries at a time.
    paged_reads "blocks" (_paged_attend_blocks, ops/paged_sparse.py) scores tiles of key_block queries x
    key_block keys with a running top-k and reads only the selected latent rows: O(key_block x
    (key_block + topk)) temporaries, flat in chunk and context length; its scores run in torch on every
    device (sparse_attention takes backend="auto"). "gather" (_paged_attend_gathered, the reference
    twin) copies the context out and calls index_topk / sparse_attention on it (fused kernels on CUDA):
    O(context) per call.
    """
    if batch is None or not isinstance(pool, DSAPool):
        raise TypeError(f"batch, pool: the paged path needs a ForwardBatch and a DSAPool, got "
                        f"{type(batch).__name__} and {type(pool).__name__}")
    if cache is not None or sequence_start is not None or absorb is False or dense:
        raise ValueError("batch: the paged path takes no cache or sequence_start and always attends "
                         "sparse in absorbed form (absorb=None, dense=False)")
    layer._check_inputs(x, None, None)
    if x.shape[:2] != (1, batch.num_tokens):
        raise ValueError(f"x: expected shape [1, total={batch.num_tokens}, hidden], got {tuple(x.shape)}")
    if layer.paged_reads not in layer.PAGED_READS:
        raise ValueError(f"paged_reads: expected one of {layer.PAGED_READS}, got {layer.paged_reads!r}")
    # With RoPE the keys are rotated here, at their positions, and stored rotated: reads never rotate again.
    c_q, q_nope, q_rope, latent, k_rope, index_keys = layer.project(x, batch.positions[None])
    pool.write(batch.slot_mapping, torch.cat([latent, k_rope], dim=-1)[0],
               None if layer.indexer is None else index_keys[0])
    w_kb, w_vb = layer._absorb_weights()
    attend = _paged_attend_blocks if layer.paged_reads == "blocks" else _paged_attend_gathered
    attn = attend(layer, batch, pool, x, c_q, q_nope, q_rope, w_kb)  # [1, total, H, kv_lora]
    return layer._gated_output(einsum(attn, w_vb, "b t h c, h v c -> b t h v"), x)


def _paged_attend_blocks(layer: nn.Module, batch: ForwardBatch, pool: DSAPool, x, c_q, q_nope, q_rope,
                         w_kb) -> torch.Tensor:
    """The paged attention [1, total, H, kv_lora], reading the pool one range of blocks at a time."""
    q = layer._absorbed_query(q_nope, q_rope, w_kb)  # [1, total, H, kv_lora + rope]
    attn = q.new_empty(*q.shape[:3], layer.kv_lora_rank)
    starts, lengths = batch.query_start.tolist(), batch.query_len.tolist()
    offloaded = pool.offloaded  # host tier: decodes read hot buffers, chunks the host
    read_latent = pool.read_latent if offloaded else partial(pool.latent_format.read, pool.latent)
    reads = (batch.block_size, read_latent, partial(pool.index_format.read, pool.index))
    decodes = batch.decode_indices()
    for group in decode_groups(decodes, batch.context_len.tolist()):
        seqs = torch.tensor(group, device=x.device)
        tokens = batch.query_start[seqs]
        one = (q[0, tokens][:, None], x[0, tokens][:, None], c_q[0, tokens][:, None])  # [S_dec, 1, *] each
        group_reads = (reads if not offloaded
                       else (reads[0], pool.hot_reader(batch.state_slot[seqs].tolist()), reads[2]))
        attn[0, tokens] = _attend_blocks(layer, *one, batch.context_len[seqs][:, None], batch.block_table[seqs],
                                         *group_reads)[:, 0]
    verify_groups = [] if offloaded else batched_verify_groups(batch, layer)
    for group in verify_groups:
        rows, real, query_pos = left_padded_rows(batch, group)  # [G, W] each
        seqs = torch.tensor(group, device=x.device)
        out = _attend_blocks(layer, q[0, rows], x[0, rows], c_q[0, rows], query_pos, batch.block_table[seqs],
                             *reads)
        attn[0, rows[real]] = out[real]
    batched = {i for group in verify_groups for i in group}
    for i in batch.chunk_indices():
        if i in batched:
            continue
        span = slice(starts[i], starts[i + 1])
        query_pos = (batch.context_len[i] + torch.arange(lengths[i], device=x.device))[None]
        attn[:, span] = _attend_blocks(layer, q[:, span], x[:, span], c_q[:, span], query_pos,
                                       batch.block_table[i:i + 1], *reads)
    return attn


def batched_verify_groups(batch: ForwardBatch, layer: nn.Module) -> list[list[int]]:
    """The verify steps that "blocks" attends together: groups of sequences (decode_groups' padding bound).

    A verify step has 1 + d rows; run one call per sequence, as prompt chunks are, a batch of 8 speculating
    sequences costs 8 small calls per layer where its plain decodes cost one. Batching them changes no
    selection as long as every member takes the same branch of _attend_blocks for all of its rows: either
    every row sees at most topk keys (the dense prefix takes them all) or none is dense (a step shorter than
    query_block never has a dense prefix of whole query blocks). So the two kinds group apart, and a step of
    more than query_block rows keeps its own call.
    """
    dense_prefix = layer.paged_dense_prefix or not layer.use_indexer
    context, lengths = batch.context_len.tolist(), batch.query_len.tolist()
    kinds: dict[bool, list[int]] = {True: [], False: []}
    for i in batch.verify_indices():
        if lengths[i] <= layer.query_block:
            kinds[dense_prefix and context[i] + lengths[i] - 1 < layer.topk].append(i)
    return [group for members in kinds.values() for group in decode_groups(members, context)]


def left_padded_rows(batch: ForwardBatch, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of the sequences `seqs` [G] laid out as [G, W] (W = their longest step), left-padded.

    Returns (rows [G, W]: flat token indices, real [G, W] bool, query_pos [G, W]). A short step's padding
    repeats its first row (same token, same position), so positions stay ascending in each row of the
    batch and a padding row only recomputes what the first real row computes; `real` drops it.
    """
    device = batch.query_start.device
    index = torch.tensor(seqs, device=device)
    lengths = batch.query_len[index]
    width = int(lengths.max())
    offset = torch.arange(width, device=device) - (width - lengths)[:, None]  # [G, W]; < 0 on padding
    real = offset >= 0
    offset = offset.clamp(min=0)
    return batch.query_start[index][:, None] + offset, real, batch.context_len[index][:, None] + offset


@record_function("attn.dsa.attend")
def _attend_blocks(layer: nn.Module, q, x, c_q, query_pos, block_table, block_size, read_latent,
                   read_index) -> torch.Tensor:
    """q [B, T, H, kv_lora + rope], x, c_q [B, T, *], query_pos [B, T] (ascending in t) -> [B, T, H, kv_lora].

    The first queries of a chunk may see at most topk keys, all of which the indexer would select: they
    attend densely (paged_dense_attention) and skip the indexer. The rest score tiles of up to key_block
    queries against each key range together (the pool is read once per tile, not once per query block),
    and attend query_block queries at a time, so their gathered rows stay O(query_block x topk). Index
    queries are projected per query block, as the gather path does (the dense prefix is cut at a query
    block boundary unless it is the whole call), so both paths rank bit-identical scores.
    """
    # without an indexer (dsa.use_indexer False) topk is max_position_embeddings: every query attends densely
    dense_prefix = layer.paged_dense_prefix or not layer.use_indexer
    seeing_all = int((query_pos < layer.topk).sum(dim=1).min()) if dense_prefix else 0
    dense = seeing_all if seeing_all == x.shape[1] else seeing_all // layer.query_block * layer.query_block
    parts = [paged_dense_attention(q[:, s:min(s + layer.query_block, dense)],
                                   query_pos[:, s:min(s + layer.query_block, dense)], block_table, block_size,
                                   read_latent, layer.kv_lora_rank, layer.scale)
             for s in range(0, dense, layer.query_block)]
    if dense < x.shape[1]:
        parts.append(_attend_selected(layer, q[:, dense:], x[:, dense:], c_q[:, dense:], query_pos[:, dense:],
                                      block_table, block_size, read_latent, read_index))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _attend_selected(layer: nn.Module, q, x, c_q, query_pos, block_table, block_size, read_latent, read_index):
    """`_attend_blocks` for queries that may see more than topk keys: the indexer's top-k, then sparse."""
    starts = range(0, x.shape[1], layer.query_block)

    def select() -> torch.Tensor:
        projected = [layer.indexer.queries(x[:, s:s + layer.query_block], c_q[:, s:s + layer.query_block],
                                           query_pos[:, s:s + layer.query_block]) for s in starts]
        q_idx, head_weights = (torch.cat(parts, dim=1) for parts in zip(*projected))
        return paged_index_topk(q_idx, head_weights, query_pos, block_table, block_size, read_index,
                                layer.indexer.topk, layer.key_block)
    with record_function("attn.dsa.indexer"):
        positions = layer._select(select)
    return torch.cat([paged_sparse_attention(q[:, s:s + layer.query_block], positions[:, s:s + layer.query_block],
                                             block_table, block_size, read_latent, layer.kv_lora_rank, layer.scale)
                      for s in starts], dim=1)


def _paged_attend_gathered(layer: nn.Module, batch: ForwardBatch, pool: DSAPool, x, c_q, q_nope, q_rope,
                           w_kb) -> torch.Tensor:
    """The paged attention [1, total, H, kv_lora] over each sequence's context copied out of the pool."""
    attn = q_nope.new_empty(*q_nope.shape[:3], layer.kv_lora_rank)  # [1, total, H, kv_lora]
    starts, lengths = batch.query_start.tolist(), batch.query_len.tolist()
    decodes = batch.decode_indices()
    for group in decode_groups(decodes, batch.context_len.tolist()):
        seqs = torch.tensor(group, device=x.device)
        tokens = batch.query_start[seqs]
        keys, keys_index, first_key = gather_left_padded(batch, pool, seqs, x.dtype)
        q, k, v = layer._absorbed_qkv(q_nope[0, tokens][:, None], q_rope[0, tokens][:, None], keys, w_kb)
        attn[0, tokens] = layer._attend(q, k, v, x[0, tokens][:, None], c_q[0, tokens][:, None], keys_index,
                                        keys.shape[1] - 1, False, first_key, batch.context_len[seqs][:, None])[:, 0]
    for i in batch.chunk_indices():
        span = slice(starts[i], starts[i + 1])
        context = int(batch.context_len[i])
        keys, keys_index = pool.read(sequence_positions(batch, i, context + lengths[i]))
        q, k, v = layer._absorbed_qkv(q_nope[:, span], q_rope[:, span], keys.to(x.dtype)[None], w_kb)
        attn[:, span] = layer._attend(q, k, v, x[:, span], c_q[:, span],
                                      None if keys_index is None else keys_index.to(x.dtype)[None], context, False,
                                      None, batch.positions[span][None])
    return attn


def gather_left_padded(batch: ForwardBatch, pool: DSAPool, seqs: torch.Tensor, dtype: torch.dtype):
    """Keys of the decoding sequences `seqs` [S_dec], right-aligned in [S_dec, N_max, *] buffers.

    Returns (latent keys [S_dec, N_max, kv_lora + rope], index keys [S_dec, N_max, d_I], first_key
    [S_dec, 1]): row j's real keys sit at N_max - n_j .. N_max - 1, so the one query at N_max - 1 sees them
    in their own order (the top-k tie rule is unchanged) and first_key = N_max - n_j hides the padding.
    """
    counts = batch.context_len[seqs] + 1
    longest = int(counts.max())
    pad = longest - counts  # [S_dec]
    token = (torch.arange(longest, device=seqs.device) - pad[:, None]).clamp(min=0)  # [S_dec, N_max]
    blocks = batch.block_table[seqs].gather(1, token // batch.block_size)
    keys, keys_index = pool.read((blocks * batch.block_size + token % batch.block_size).flatten())
    shape = (len(seqs), longest, -1)
    index = None if keys_index is None else keys_index.to(dtype).reshape(shape)  # None: index sharing reuser
    return keys.to(dtype).reshape(shape), index, pad[:, None]


def sequence_positions(batch: ForwardBatch, seq: int, count: int) -> torch.Tensor:
    """Flat pool positions [count] of sequence `seq`'s tokens 0 .. count-1, through its block table."""
    token = torch.arange(count, device=batch.block_table.device)
    return batch.block_table[seq, token // batch.block_size] * batch.block_size + token % batch.block_size


def decode_groups(decodes: list[int], context_lens: list[int], max_padding: float = 2.0) -> list[list[int]]:
    """Split the decoding sequences into batches whose left-padded keys stay within max_padding x the real ones.

    One long context among short ones would otherwise make every short decode score and gather as many
    keys as the long one. Longest first, a group grows while count x longest <= max_padding x real keys.
    """
    groups, real = [], 0
    for seq in sorted(decodes, key=lambda i: -context_lens[i]):
        keys = context_lens[seq] + 1
        if groups and (len(groups[-1]) + 1) * (context_lens[groups[-1][0]] + 1) <= max_padding * (real + keys):
            groups[-1].append(seq)
            real += keys
        else:
            groups.append([seq])
            real = keys
    return groups
