"""Block-wise DSA over a paged pool (docs/design.md §1.4, §6.3): the lightning indexer's causal top-k and the
sparse attention, read through block tables one range of pool blocks at a time.

The gather path (GatedDSA's reference twin) copies a sequence's whole context out of the pool and scores it
in one piece: O(queries x context) temporaries per chunk. Here the context is walked in key ranges of
whole pool blocks:

    for each tile of Q queries, for each range r of blocks it can see:
                                  I_r = index_scores(q_idx, keys of r)           [B, Q, R]
                                  running top-k = best k of (running top-k, I_r)   [B, Q, k]
    attention                     reads only the k selected rows per query        [B, T * k, D]

so the indexer holds O(Q x (R + k)) at once (Q, R ~ key_block), whatever the chunk and the context length.
The selection equals index_topk's on the gathered context exactly, tie rule included: a higher score wins,
equal scores go to the EARLIER position. It holds because ranges run in ascending position order and the
merge keeps what a stable sort of [running best-first | new range ascending] keeps first: every running
entry sits before every new one and has an earlier position, and running entries of equal score are
already in position order.

A query that sees at most k keys (query_pos < k) gets every one of them from the indexer, so its sparse
attention is dense causal attention: `paged_dense_attention` computes that directly, reading each key
row once for all such queries instead of once per query, and skips the indexer (GatedDSA routes the
queries of a chunk that qualify; paged_sparse_attention on index_topk's positions is its twin).

Shapes: B sequences, T queries per sequence, HI/DI indexer heads/dim, H heads, D key dim, DV value dim.
`query_pos` [B, T] is each query's position in its own sequence (it sees keys 0 .. query_pos).
`block_table` [B, max_blocks] holds each sequence's pool block ids in order, -1 past its last block.
A reader maps flat pool positions [M] (block_id * block_size + offset) to rows [M, dim] (a pool format's read).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from einops import einsum

from latentmoe_lab.ops.sparse_attention import _compute_dtype, _masked_softmax, index_scores, sparse_attention

Reader = Callable[[torch.Tensor], torch.Tensor]


def paged_index_topk(q_idx: torch.Tensor, w: torch.Tensor, query_pos: torch.Tensor, block_table: torch.Tensor,
                     block_size: int, read_index: Reader, k: int, key_block: int = 512) -> torch.Tensor:
    """The indexer's causal top-k, scoring tiles of key_block queries x ~key_block keys (whole blocks) at a time.

    q_idx [B, T, HI, DI]; w [B, T, HI]; query_pos [B, T] int64 -> positions [B, T, k] int64 in each sequence's
    own coordinates, best first, -1 past the query_pos + 1 visible keys. A tile of queries scores only the
    key ranges its latest query sees, so a whole prompt costs the causal triangle, not the square. Peak
    temporaries O(key_block x (key_block + k)): flat in T and in context length.
    """
    _check_paged(query_pos, block_table, block_size, q_idx.shape[:2], "q_idx")
    for name, value in (("k", k), ("key_block", key_block)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    tiles = [_tile_topk(q_idx[:, t:t + key_block], w[:, t:t + key_block], query_pos[:, t:t + key_block],
                        block_table, block_size, read_index, k, key_block)
             for t in range(0, q_idx.shape[1], key_block)]
    if not tiles:  # no queries
        return torch.full((*query_pos.shape, k), -1, dtype=torch.long, device=q_idx.device)
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)


def _tile_topk(q_idx, w, query_pos, block_table, block_size, read_index, k, key_block) -> torch.Tensor:
    """paged_index_topk for one tile of queries: the key ranges in order, merged into a running top-k.

    A range holds about key_block^2 / (B x T) keys, so every tile scores at most ~key_block^2 (query, key)
    pairs at once: a full tile of prefill queries takes key_block keys a range, a batch of decodes far more
    (fewer, larger ranges; the same bound on memory).
    """
    device = q_idx.device
    blocks_per_range = max(1, key_block * key_block // (query_pos.numel() * block_size))
    num_keys, always_visible = int(query_pos.max()) + 1, int(query_pos.min()) + 1
    dtype = torch.float64 if q_idx.dtype == torch.float64 else torch.float32  # index_scores' output dtype
    # The running top-k, best first; it starts as k hidden (-inf) entries, which every visible key outranks.
    best = torch.full((*query_pos.shape, k), float("-inf"), dtype=dtype, device=device)
    best_pos = torch.full((*query_pos.shape, k), -1, dtype=torch.long, device=device)
    for first in range(0, -(-num_keys // block_size), blocks_per_range):
        stop = min(first + blocks_per_range, block_table.shape[1])
        columns = torch.arange(first, stop, device=device)
        positions = (columns[:, None] * block_size + torch.arange(block_size, device=device)).flatten()  # [R]
        keys = _read(read_index, block_table, block_size, positions[None].expand(len(block_table), -1))
        # As select_topk: visible scores clamp to the dtype's min, so they rank above every hidden key (-inf).
        scores = index_scores(q_idx, keys.to(q_idx.dtype), w).clamp_(min=torch.finfo(dtype).min)  # [B, T, R]
        if stop * block_size > always_visible:  # the range reaches past some query: hide its later keys
            scores.masked_fill_(positions > query_pos[..., None], float("-inf"))
        candidates = torch.cat([best, scores], dim=-1)
        order = _best_first(candidates, k)
        best = candidates.gather(-1, order)
        # order < k picks a running entry, else the new range's position order - k.
        best_pos = torch.where(order < k, best_pos.gather(-1, order.clamp(max=k - 1)),
                               positions[(order - k).clamp(min=0)])
    # Slots past the visible keys hold hidden entries: pad them.
    return torch.where(torch.arange(k, device=device) <= query_pos[..., None], best_pos, -1)


def paged_sparse_attention(q: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, block_size: int,
                           read_latent: Reader, value_dim: int, scale: float, backend: str = "auto") -> torch.Tensor:
    """Absorbed-MLA sparse attention over only the selected pool rows (one shared KV head).

    q [B, T, H, D]; positions [B, T, k] (paged_index_topk's, -1 pads); read_latent gives rows [M, D] whose first
    value_dim channels are V -> [B, T, H, value_dim]. Reads B x T x k rows: O(T x k) temporaries.
    """
    _check_table(block_table, block_size, q.shape[0])
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 3 \
            or positions.shape[:2] != q.shape[:2] or positions.shape[-1] < 1:
        raise ValueError(f"positions: expected an int64 tensor [B, T, k >= 1] with [B, T] = {tuple(q.shape[:2])}")
    batch, queries, kk = positions.shape
    if int(positions.min()) < -1 or int(positions.max()) >= block_table.shape[1] * block_size or bool(
            (block_table.gather(1, positions.clamp(min=0).view(batch, -1) // block_size) < 0).any()):
        raise ValueError("positions: values must be -1 or positions inside each sequence's blocks "
                         f"(block_table: {block_table.shape[1]} x {block_size} positions, -1 for no block)")
    # A padded slot reads the sequence's first key (always written); sparse_attention masks it.
    rows = _read(read_latent, block_table, block_size, positions.clamp(min=0).view(batch, queries * kk))
    keys = rows.to(q.dtype)[:, :, None, :]  # [B, T * k, 1, D]
    local = torch.arange(queries * kk, device=q.device).view(queries, kk)
    indices = torch.where(positions >= 0, local, -1)  # query t's rows sit at t * k .. t * k + k - 1
    return sparse_attention(q, keys, keys[..., :value_dim], indices, scale=scale, backend=backend)


def paged_dense_attention(q: torch.Tensor, query_pos: torch.Tensor, block_table: torch.Tensor, block_size: int,
                          read_latent: Reader, value_dim: int, scale: float) -> torch.Tensor:
    """Absorbed-MLA causal attention over every visible key: query (b, t) attends positions 0 .. query_pos[b, t].

    q [B, T, H, D]; query_pos [B, T] int64 -> [B, T, H, value_dim]. Equal to paged_sparse_attention when the
    indexer selects every visible key (query_pos < its k), up to the order of the softmax sums. Reads the
    B x (max(query_pos) + 1) rows once; temporaries O(B x H x T x max(query_pos)).
    """
    _check_paged(query_pos, block_table, block_size, q.shape[:2], "q")
    if not isinstance(value_dim, int) or isinstance(value_dim, bool) or not 0 < value_dim <= q.shape[-1]:
        raise ValueError(f"value_dim: expected an int in [1, D={q.shape[-1]}], got {value_dim!r}")
    if q.shape[1] == 0:
        return q.new_zeros(*q.shape[:3], value_dim)
    positions = torch.arange(int(query_pos.max()) + 1, device=q.device)  # [N]
    dtype = _compute_dtype(q)
    keys = _read(read_latent, block_table, block_size, positions[None].expand(q.shape[0], -1)).to(dtype)  # [B, N, D]
    visible = positions <= query_pos[..., None]  # [B, T, N]; rows past a short sequence's end are hidden here
    logits = einsum(q.to(dtype), keys, "b t h d, b n d -> b t h n") * scale
    probs = _masked_softmax(logits, visible[:, :, None, :])
    return einsum(probs, keys[..., :value_dim], "b t h n, b n e -> b t h e").to(q.dtype)


def _best_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, T, N] -> indices [B, T, min(k, N)] of the k best, best first, equal scores by lower index.

    What a stable descending sort's first k are, in O(N) per row (a full sort per range would dominate): the k-th
    best score is the threshold, everything above it is in, and of the scores equal to it the lowest
    indices fill the remaining slots; only the k chosen are then sorted.
    """
    kept = min(k, scores.shape[-1])
    threshold = scores.topk(kept, dim=-1).values[..., -1:]
    above, tied = scores > threshold, scores == threshold
    room = kept - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= room))  # exactly `kept` per row
    index = chosen.nonzero()[:, -1].view(*scores.shape[:2], kept)  # ascending in each row
    return index.gather(-1, scores.gather(-1, index).sort(dim=-1, descending=True, stable=True).indices)


def _read(reader: Reader, block_table: torch.Tensor, block_size: int, positions: torch.Tensor) -> torch.Tensor:
    """positions [B, N] in each sequence's coordinates -> rows [B, N, dim] through the block table.

    Positions past a sequence's last block (a short sequence in a range sized for a longer one) read its
    first block instead; the caller hides them, and they never touch another sequence's or an unwritten block.
    """
    column = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.gather(1, column)
    blocks = torch.where(blocks >= 0, blocks, block_table[:, :1])
    rows = reader((blocks * block_size + positions % block_size).flatten())
    return rows.view(*positions.shape, rows.shape[-1])


def _check_table(block_table: torch.Tensor, block_size: int, batch: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int64 or block_table.dim() != 2:
        raise TypeError("block_table: expected an int64 tensor [B, max_blocks]")
    if block_table.shape[0] != batch or block_table.shape[1] < 1 or bool((block_table[:, 0] < 0).any()):
        raise ValueError(f"block_table: expected [B={batch}, max_blocks >= 1] with a first block in every row, "
                         f"got shape {tuple(block_table.shape)}")


def _check_paged(query_pos: torch.Tensor, block_table: torch.Tensor, block_size: int, leading: torch.Size,
                 name: str) -> None:
    _check_table(block_table, block_size, leading[0])
    if not isinstance(query_pos, torch.Tensor) or query_pos.dtype != torch.int64 or query_pos.dim() != 2:
        raise TypeError("query_pos: expected an int64 tensor [B, T]")
    if tuple(query_pos.shape) != tuple(leading):
        raise ValueError(f"query_pos: expected shape [B, T] = {tuple(leading)} like {name}, "
                         f"got {tuple(query_pos.shape)}")
    if query_pos.numel() and int(query_pos.min()) < 0:
        raise ValueError("query_pos: positions must be >= 0")
    if query_pos.numel() and int(query_pos.max()) >= block_table.shape[1] * block_size:
        raise ValueError(f"query_pos: reaches {int(query_pos.max())}, past the block table's "
                         f"{block_table.shape[1]} x {block_size} positions")
    last_block = block_table.gather(1, query_pos.max(dim=1, keepdim=True).values // block_size) if query_pos.numel() \
        else block_table[:, :1]
    if bool((last_block < 0).any()):
        raise ValueError("query_pos: reaches past a sequence's last block (-1 in its block_table row)")
