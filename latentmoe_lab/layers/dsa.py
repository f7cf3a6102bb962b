"""Gated DSA: DeepSeek Sparse Attention on multi-head latent attention (MLA), with a sigmoid output gate
(docs/design.md §1.4).

    c_q  = RMSNorm(W_qa x)                      q = W_qb c_q -> per head [q_nope | q_rope]
    c_kv = RMSNorm(W_kva x)[:kv_lora]           k_rope = (W_kva x)[kv_lora:]  (NoPE: never rotated, one for all heads)
    [k_nope | v] = W_kvb c_kv per head          K = [k_nope | k_rope], scale = (nope + rope)^-1/2
    S_t  = TopK_{s <= t} sum_j w_tj ReLU(q^I_tj . k^I_s)     (lightning indexer, shared by all heads)
    out  = W_o [ softmax-attention over S_t  *  sigmoid(W_g x) ]

The cache keeps per token only c_kv, k_rope and the index key. Two equal ways to attend over it:
  expanded  - rebuild per-head K, V from the cached latent with W_kvb (cheap for dense multi-token attention);
  absorbed  - fold W_kvb's key half into the query and its value half into the output, and attend
              MQA-style (one shared head of size kv_lora + rope) directly over the cache (decode, and
              the sparse path, where one gather of the selected latent rows serves every head).
The sparse path scores and attends in query blocks, so prefill holds [B, block, S] index scores at a time;
the paged (serving) path also walks the keys in ranges of pool blocks, so nothing it holds grows with S.
With a host tier (offload_tier.py, docs/design.md §15.1) decodes read their selected rows through the
sequence's hot buffer; with dsa.index_share_every > 1 a layer may replay another's selections (§15.2).
Shapes: B batch, T new tokens, S cached + new tokens, H heads; per-head tensors are [B, T, H, D].
"""
from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from einops import einsum, rearrange
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import check_sequence_start
from latentmoe_lab.ops.activations import sigmoid
from latentmoe_lab.ops.paged_sparse import paged_dense_attention, paged_index_topk, paged_sparse_attention
from latentmoe_lab.ops.sparse_attention import (dense_causal_attention, index_scores, index_topk,
                                                sparse_attention)
from latentmoe_lab.offload_tier import OffloadedDSAPool
from latentmoe_lab.paged_pools import DSAPool


class LightningIndexer(nn.Module):
    """Scores every causal key per query with a few cheap ReLU heads; the top-k pick what attention sees."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        idx = config.indexer
        self.num_heads, self.head_dim, self.topk = idx.num_heads, idx.head_dim, idx.topk
        self.wq = nn.Linear(config.mla.q_lora_rank, idx.num_heads * idx.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, idx.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(idx.head_dim, eps=config.rms_norm_eps)
        self.w_heads = nn.Linear(config.hidden_size, idx.num_heads, bias=False)
        # Keeps the summed head scores O(1) whatever the number and size of index heads.
        self.head_scale = (idx.num_heads * idx.head_dim) ** -0.5

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> index keys [B, T, DI] (what the cache stores)."""
        return self.k_norm(self.wk(x))

    def queries(self, x: torch.Tensor, c_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden], c_q: [B, T, q_lora] -> index queries [B, T, HI, DI] and head weights [B, T, HI]."""
        q_idx = rearrange(self.wq(c_q), "b t (j d) -> b t j d", j=self.num_heads)
        return q_idx, self.w_heads(x) * self.head_scale

    @record_function("attn.dsa.indexer")
    def scores(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden], c_q: [B, T, q_lora], index_keys: [B, S, DI] -> I [B, T, S] fp32 (not masked)."""
        q_idx, head_weights = self.queries(x, c_q)
        return index_scores(q_idx, index_keys, head_weights)

    @record_function("attn.dsa.indexer")
    def select(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor, offset: int,
               first_key: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden], c_q: [B, T, q_lora], index_keys: [B, S, DI] -> positions [B, T, topk] (-1 pads).

        first_key [B, T]: the earliest key each query may see (packed sequences: its own sequence's start).
        """
        q_idx, head_weights = self.queries(x, c_q)
        return index_topk(q_idx, index_keys, head_weights, self.topk, offset, first_key)

    def select_blocks(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor, offset: int,
                      block: int, first_key: torch.Tensor | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield (start, stop, positions [B, stop - start, topk]) for query blocks of `block` tokens.

        A block scores only the keys it can see (index_keys[:, :offset + stop]), so the scores alive at
        any time are [B, block, S]: O(block * S) memory, not O(T * S). Same positions as one `select`.
        """
        for start in range(0, x.shape[1], block):
            stop = min(start + block, x.shape[1])
            yield start, stop, self.select(x[:, start:stop], c_q[:, start:stop], index_keys[:, :offset + stop],
                                           offset + start, None if first_key is None else first_key[:, start:stop])


class SharedSelection:
    """The top-k selections of one indexer layer's latest forward, in call order, for the DSA layers after it
    that reuse them (dsa.index_share_every > 1, docs/design.md §15.2). Both layers split a forward into the
    same query blocks, decode groups and chunks, so the n-th selection of the source is the reuser's n-th."""

    def __init__(self, source_layer: int):
        self.source_layer, self.entries = source_layer, []

    def record(self, positions: torch.Tensor) -> torch.Tensor:
        self.entries.append(positions)
        return positions


class GatedDSA(nn.Module):
    """forward(x [B, T, hidden], cache=None, absorb=None, dense=False) -> [B, T, hidden].

    query_block: queries scored and attended together in the sparse path (bounds prefill memory).
    key_block: the paged path scores tiles of key_block queries x key_block keys (whole pool blocks, >= one).
    paged_reads (attribute): "blocks" (default) reads the paged pool one key range at a time, so a chunk's
    temporaries do not grow with its context; "gather" copies each sequence's context out first (the
    reference twin, same selection, outputs equal to rounding).
    paged_dense_prefix (attribute): True (default) lets "blocks" queries that see at most topk keys attend
    densely without the indexer (it would select every one of them); False sends them through it too.
    """

    PAGED_READS = ("blocks", "gather")

    def __init__(self, config: ModelConfig, query_block: int = 64, key_block: int = 512):
        super().__init__()
        for name, value in (("query_block", query_block), ("key_block", key_block)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.query_block, self.key_block = query_block, key_block
        self.topk = config.indexer.topk  # also known to a layer that reuses another's selection (no indexer)
        self.paged_reads = "blocks"
        self.paged_dense_prefix = True
        mla = config.mla
        self.hidden_size = config.hidden_size
        self.num_heads = mla.num_heads
        self.nope_dim, self.rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = mla.kv_lora_rank, mla.v_head_dim
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        eps = config.rms_norm_eps

        self.wq_a = nn.Linear(config.hidden_size, mla.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(mla.q_lora_rank, eps)
        self.wq_b = nn.Linear(mla.q_lora_rank, mla.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.wkv_a = nn.Linear(config.hidden_size, mla.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, eps)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, mla.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.indexer = LightningIndexer(config)
        # index sharing (share_selection): "source" records its selections into shared_selection, "reuse"
        # replays them and has no indexer of its own
        self.selection_role, self.shared_selection, self._replayed = "own", None, 0
        self.w_gate = nn.Linear(config.hidden_size, mla.num_heads * mla.v_head_dim, bias=False)
        self.wo = nn.Linear(mla.num_heads * mla.v_head_dim, config.hidden_size, bias=False)

    def share_selection(self, shared: SharedSelection, role: str) -> None:
        """Take part in index sharing: role "source" records every selection into `shared`; "reuse" drops this
        layer's indexer (no weights, no index keys) and replays the source's selections instead."""
        if role not in ("source", "reuse"):
            raise ValueError(f"role: expected 'source' or 'reuse', got {role!r}")
        self.selection_role, self.shared_selection = role, shared
        if role == "reuse":
            self.indexer = None

    def _select(self, compute) -> torch.Tensor:
        """The next top-k selection: computed by this layer's indexer (and recorded, for a source) or replayed."""
        if self.selection_role == "own":
            return compute()
        if self.selection_role == "source":
            return self.shared_selection.record(compute())
        entries = self.shared_selection.entries
        if self._replayed >= len(entries):
            raise RuntimeError(f"dsa.index_share_every: this layer reuses layer {self.shared_selection.source_layer}'s "
                               "selections, but that layer did not run this forward first (or split it otherwise)")
        self._replayed += 1
        return entries[self._replayed - 1]

    def _begin_selections(self) -> None:
        if self.selection_role == "source":
            self.shared_selection.entries = []
        self._replayed = 0

    @record_function("attn.dsa")
    def forward(self, x: torch.Tensor, cache: DSALayerCache | None = None, absorb: bool | None = None,
                dense: bool = False, sequence_start: torch.Tensor | None = None,
                batch: ForwardBatch | None = None, pool: DSAPool | None = None) -> torch.Tensor:
        """Attend the T new tokens over the cache (if given, appended to first) and themselves.

        absorb=None picks the absorbed form for sparse attention (one top-k gather of the latent serves
        every head, instead of one gather of per-head K and V each) and for decode (a cache and T == 1),
        the expanded form for dense multi-token attention.
        dense=True skips the indexer and attends over every causal position (the equality reference).
        sequence_start [B, T] int64 (packed sequences, no cache): position of the first token of each token's
        own sequence; no query sees a key before it.
        batch + pool (serving, docs/design.md §6.4): x is [1, total, hidden], the new tokens of batch's S
        sequences, written to the paged pool and attending over their own sequence's keys (sparse, absorbed).
        """
        self._begin_selections()
        if batch is not None or pool is not None:
            return self._forward_paged(x, batch, pool, cache, absorb, dense, sequence_start)
        self._check_inputs(x, cache, absorb)
        check_sequence_start(sequence_start, x, cache)
        if absorb is None:
            absorb = not dense or (cache is not None and x.shape[1] == 1)

        c_q, q_nope, q_rope, latent, k_rope, index_keys = self.project(x)
        offset = 0
        if cache is None:
            latent_rope = torch.cat([latent, k_rope], dim=-1)
        else:
            offset = cache.length
            cache.append(latent, k_rope, index_keys)
            latent_rope, index_keys = cache.absorbed_keys, cache.index_keys  # views, no copy of the cache

        if absorb:
            w_kb, w_vb = self._absorb_weights()
            attn = self._attend(*self._absorbed_qkv(q_nope, q_rope, latent_rope, w_kb), x, c_q, index_keys,
                                offset, dense, sequence_start)  # [B, T, H, kv_lora]
            attn = einsum(attn, w_vb, "b t h c, h v c -> b t h v")  # W_vb moves after the softmax
        else:
            attn = self._attend(*self._expanded_qkv(q_nope, q_rope, latent_rope), x, c_q, index_keys, offset, dense,
                                sequence_start)
        return self._gated_output(attn, x)

    def _gated_output(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """attn [B, T, H, v] -> W_o [attn * sigmoid(W_g x)] [B, T, hidden]."""
        gate = sigmoid(rearrange(self.w_gate(x), "b t (h d) -> b t h d", h=self.num_heads))
        return self.wo(rearrange(attn * gate, "b t h d -> b t (h d)"))

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_kvb split per head into its key half [H, nope, kv_lora] and value half [H, v, kv_lora]."""
        w_kb, w_vb = rearrange(self.wkv_b.weight, "(h d) c -> h d c", h=self.num_heads).split(
            [self.nope_dim, self.v_head_dim], dim=1)
        return w_kb, w_vb

    def attention_probs(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> dense causal attention weights [B, H, T, T], fp32 or fp64 (no cache).

        What dense=True attends with; the indexer's warm-up learns to rank keys by their head sum.
        """
        self._check_inputs(x, None, None)
        _, q_nope, q_rope, latent, k_rope, _ = self.project(x)
        q, k, _ = self._expanded_qkv(q_nope, q_rope, torch.cat([latent, k_rope], dim=-1))
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax in fp32 at least
        logits = einsum(q.to(dtype), k.to(dtype), "b t h d, b s h d -> b h t s") * self.scale
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [B, T, hidden] -> c_q, q_nope, q_rope ([B, T, H, *]), latent, k_rope and index keys ([B, T, *]).

        Everything forward computes before attention; the last three are what a DSALayerCache stores.
        """
        c_q = self.q_norm(self.wq_a(x))
        q = rearrange(self.wq_b(c_q), "b t (h d) -> b t h d", h=self.num_heads)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        index_keys = x.new_zeros(*x.shape[:2], 0) if self.indexer is None else self.indexer.keys(x)  # reuse: none
        return c_q, q_nope, q_rope, self.kv_norm(kv_latent), k_rope, index_keys

    # ------------------------------------------------------------------------------ attention forms
    def _expanded_qkv(self, q_nope, q_rope, latent_rope):
        """Per-head K = [k_nope | k_rope] and V from W_kvb over the latent. latent_rope: [B, S, kv_lora + rope]."""
        latent, k_rope = latent_rope.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = rearrange(self.wkv_b(latent), "b s (h d) -> b s h d", h=self.num_heads)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k_rope_heads = k_rope[:, :, None, :].expand(-1, -1, self.num_heads, -1)
        return torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope_heads], dim=-1), v

    def _absorbed_qkv(self, q_nope, q_rope, latent_rope, w_kb):
        """MQA over the latent: q_nope . (W_kb c_kv) = (q_nope W_kb) . c_kv; one shared K = [c_kv | k_rope], V = c_kv.

        V is returned as a view of K's leading channels, so sparse_attention gathers each selected row once.
        """
        k = latent_rope[:, :, None, :]  # [B, S, 1, kv_lora + rope]
        return self._absorbed_query(q_nope, q_rope, w_kb), k, k[..., :self.kv_lora_rank]

    @staticmethod
    def _absorbed_query(q_nope, q_rope, w_kb):
        """[B, T, H, nope], [B, T, H, rope], W_kb [H, nope, kv_lora] -> q [B, T, H, kv_lora + rope]."""
        return torch.cat([einsum(q_nope, w_kb, "b t h n, h n c -> b t h c"), q_rope], dim=-1)

    @record_function("attn.dsa.attend")
    def _attend(self, q, k, v, x, c_q, index_keys, offset, dense, first_key=None):
        """Dense causal attention, or sparse attention over the indexer's top-k, one query block at a time."""
        if dense and first_key is not None:  # every key of the query's own sequence, through the sparse op
            keys = torch.arange(k.shape[1], device=q.device)
            query_pos = torch.arange(q.shape[1], device=q.device)[:, None] + offset
            visible = (keys >= first_key[..., None]) & (keys <= query_pos)  # [B, T, S]
            return sparse_attention(q, k, v, torch.where(visible, keys, -1), scale=self.scale)
        if dense:
            return dense_causal_attention(q, k, v, scale=self.scale, offset=offset)
        blocks = [sparse_attention(q[:, start:stop], k, v, indices, scale=self.scale)
                  for start, stop, indices in self._select_blocks(x, c_q, index_keys, offset, first_key)]
        return torch.cat(blocks, dim=1) if blocks else q.new_zeros(*q.shape[:3], v.shape[-1])

    def _select_blocks(self, x, c_q, index_keys, offset, first_key):
        """(start, stop, positions) per block of query_block queries: LightningIndexer.select_blocks (recorded
        for the layers that reuse it), or, in a reusing layer, the source layer's replayed."""
        if self.indexer is not None:
            for start, stop, positions in self.indexer.select_blocks(x, c_q, index_keys, offset, self.query_block,
                                                                     first_key):
                yield start, stop, self._select(lambda: positions)
            return
        for start in range(0, x.shape[1], self.query_block):
            yield start, min(start + self.query_block, x.shape[1]), self._select(None)

    # ------------------------------------------------------------------------------ paged (serving)
    def _forward_paged(self, x: torch.Tensor, batch: ForwardBatch | None, pool: DSAPool | None,
                       cache, absorb, dense, sequence_start) -> torch.Tensor:
        """x [1, total, hidden] of batch's S sequences -> [1, total, hidden], through the paged pool.

        The new [c_kv | k_rope] and index keys go to pool positions slot_mapping first; then every query
        scores its own sequence's keys, read through the block table (context_len + its new tokens), takes
        the indexer's top-k and attends in absorbed form: the selection the contiguous cache makes. Decodes
        run batched (see _decode_groups); each prefill chunk runs on its own, query_block queries at a time.
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
        self._check_inputs(x, None, None)
        if x.shape[:2] != (1, batch.num_tokens):
            raise ValueError(f"x: expected shape [1, total={batch.num_tokens}, hidden], got {tuple(x.shape)}")
        if self.paged_reads not in self.PAGED_READS:
            raise ValueError(f"paged_reads: expected one of {self.PAGED_READS}, got {self.paged_reads!r}")
        c_q, q_nope, q_rope, latent, k_rope, index_keys = self.project(x)
        pool.write(batch.slot_mapping, torch.cat([latent, k_rope], dim=-1)[0],
                   None if self.indexer is None else index_keys[0])
        w_kb, w_vb = self._absorb_weights()
        attend = self._paged_attend_blocks if self.paged_reads == "blocks" else self._paged_attend_gathered
        attn = attend(batch, pool, x, c_q, q_nope, q_rope, w_kb)  # [1, total, H, kv_lora]
        return self._gated_output(einsum(attn, w_vb, "b t h c, h v c -> b t h v"), x)

    def _paged_attend_blocks(self, batch: ForwardBatch, pool: DSAPool, x, c_q, q_nope, q_rope, w_kb) -> torch.Tensor:
        """The paged attention [1, total, H, kv_lora], reading the pool one range of blocks at a time."""
        q = self._absorbed_query(q_nope, q_rope, w_kb)  # [1, total, H, kv_lora + rope]
        attn = q.new_empty(*q.shape[:3], self.kv_lora_rank)
        starts, lengths = batch.query_start.tolist(), batch.query_len.tolist()
        offloaded = isinstance(pool, OffloadedDSAPool)  # host tier: decodes read hot buffers, chunks the host
        read_latent = pool.read_latent if offloaded else partial(pool.latent_format.read, pool.latent)
        reads = (batch.block_size, read_latent, partial(pool.index_format.read, pool.index))
        decodes = batch.decode_indices()
        for group in _decode_groups(decodes, batch.context_len.tolist()):
            seqs = torch.tensor(group, device=x.device)
            tokens = batch.query_start[seqs]
            one = (q[0, tokens][:, None], x[0, tokens][:, None], c_q[0, tokens][:, None])  # [S_dec, 1, *] each
            group_reads = (reads if not offloaded
                           else (reads[0], pool.hot_reader(batch.state_slot[seqs].tolist()), reads[2]))
            attn[0, tokens] = self._attend_blocks(*one, batch.context_len[seqs][:, None], batch.block_table[seqs],
                                                  *group_reads)[:, 0]
        for i in batch.chunk_indices():
            span = slice(starts[i], starts[i + 1])
            query_pos = (batch.context_len[i] + torch.arange(lengths[i], device=x.device))[None]
            attn[:, span] = self._attend_blocks(q[:, span], x[:, span], c_q[:, span], query_pos,
                                                batch.block_table[i:i + 1], *reads)
        return attn

    @record_function("attn.dsa.attend")
    def _attend_blocks(self, q, x, c_q, query_pos, block_table, block_size, read_latent, read_index) -> torch.Tensor:
        """q [B, T, H, kv_lora + rope], x, c_q [B, T, *], query_pos [B, T] (ascending in t) -> [B, T, H, kv_lora].

        The first queries of a chunk may see at most topk keys, all of which the indexer would select: they
        attend densely (paged_dense_attention) and skip the indexer. The rest score tiles of up to key_block
        queries against each key range together (the pool is read once per tile, not once per query block),
        and attend query_block queries at a time, so their gathered rows stay O(query_block x topk). Index
        queries are projected per query block, as the gather path does (the dense prefix is cut at a query
        block boundary unless it is the whole call), so both paths rank bit-identical scores.
        """
        seeing_all = int((query_pos < self.topk).sum(dim=1).min()) if self.paged_dense_prefix else 0
        dense = seeing_all if seeing_all == x.shape[1] else seeing_all // self.query_block * self.query_block
        parts = [paged_dense_attention(q[:, s:min(s + self.query_block, dense)],
                                       query_pos[:, s:min(s + self.query_block, dense)], block_table, block_size,
                                       read_latent, self.kv_lora_rank, self.scale)
                 for s in range(0, dense, self.query_block)]
        if dense < x.shape[1]:
            parts.append(self._attend_selected(q[:, dense:], x[:, dense:], c_q[:, dense:], query_pos[:, dense:],
                                               block_table, block_size, read_latent, read_index))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _attend_selected(self, q, x, c_q, query_pos, block_table, block_size, read_latent, read_index):
        """`_attend_blocks` for queries that may see more than topk keys: the indexer's top-k, then sparse."""
        starts = range(0, x.shape[1], self.query_block)

        def select() -> torch.Tensor:
            projected = [self.indexer.queries(x[:, s:s + self.query_block], c_q[:, s:s + self.query_block])
                         for s in starts]
            q_idx, head_weights = (torch.cat(parts, dim=1) for parts in zip(*projected))
            return paged_index_topk(q_idx, head_weights, query_pos, block_table, block_size, read_index,
                                    self.indexer.topk, self.key_block)
        with record_function("attn.dsa.indexer"):
            positions = self._select(select)
        return torch.cat([paged_sparse_attention(q[:, s:s + self.query_block], positions[:, s:s + self.query_block],
                                                 block_table, block_size, read_latent, self.kv_lora_rank, self.scale)
                          for s in starts], dim=1)

    def _paged_attend_gathered(self, batch: ForwardBatch, pool: DSAPool, x, c_q, q_nope, q_rope, w_kb) -> torch.Tensor:
        """The paged attention [1, total, H, kv_lora] over each sequence's context copied out of the pool."""
        attn = q_nope.new_empty(*q_nope.shape[:3], self.kv_lora_rank)  # [1, total, H, kv_lora]
        starts, lengths = batch.query_start.tolist(), batch.query_len.tolist()
        decodes = batch.decode_indices()
        for group in _decode_groups(decodes, batch.context_len.tolist()):
            seqs = torch.tensor(group, device=x.device)
            tokens = batch.query_start[seqs]
            keys, keys_index, first_key = self._gather_left_padded(batch, pool, seqs, x.dtype)
            q, k, v = self._absorbed_qkv(q_nope[0, tokens][:, None], q_rope[0, tokens][:, None], keys, w_kb)
            attn[0, tokens] = self._attend(q, k, v, x[0, tokens][:, None], c_q[0, tokens][:, None], keys_index,
                                           keys.shape[1] - 1, False, first_key)[:, 0]
        for i in batch.chunk_indices():
            span = slice(starts[i], starts[i + 1])
            context = int(batch.context_len[i])
            keys, keys_index = pool.read(_sequence_positions(batch, i, context + lengths[i]))
            q, k, v = self._absorbed_qkv(q_nope[:, span], q_rope[:, span], keys.to(x.dtype)[None], w_kb)
            attn[:, span] = self._attend(q, k, v, x[:, span], c_q[:, span],
                                         None if keys_index is None else keys_index.to(x.dtype)[None], context, False)
        return attn

    def _gather_left_padded(self, batch: ForwardBatch, pool: DSAPool, seqs: torch.Tensor, dtype: torch.dtype):
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

    # ------------------------------------------------------------------------------------ checks
    def _check_inputs(self, x: torch.Tensor, cache: DSALayerCache | None, absorb: bool | None) -> None:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"x: expected a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected 3 dims [B, T, hidden={self.hidden_size}], got shape {tuple(x.shape)}")
        if cache is not None:
            if not isinstance(cache, DSALayerCache):
                raise TypeError(f"cache: expected a DSALayerCache or None, got {type(cache).__name__}")
            if cache.length and cache.latent.shape[0] != x.shape[0]:
                raise ValueError(f"cache: holds batch size {cache.latent.shape[0]} but x has {x.shape[0]}")
        if absorb is not None and not isinstance(absorb, bool):
            raise TypeError(f"absorb: expected a bool or None, got {type(absorb).__name__}")



def _sequence_positions(batch: ForwardBatch, seq: int, count: int) -> torch.Tensor:
    """Flat pool positions [count] of sequence `seq`'s tokens 0 .. count-1, through its block table."""
    token = torch.arange(count, device=batch.block_table.device)
    return batch.block_table[seq, token // batch.block_size] * batch.block_size + token % batch.block_size


def _decode_groups(decodes: list[int], context_lens: list[int], max_padding: float = 2.0) -> list[list[int]]:
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


def link_shared_indexers(config: ModelConfig, attentions: list[nn.Module]) -> None:
    """Wire dsa.index_share_every: each DSA layer of `attentions` (config.layer_types order) whose index source
    is another layer reuses that layer's selections (docs/design.md §15.2). A no-op at the default of 1."""
    for layer_idx, attn in enumerate(attentions):
        if not isinstance(attn, GatedDSA) or config.index_source(layer_idx) == layer_idx:
            continue
        source = attentions[config.index_source(layer_idx)]
        if source.shared_selection is None:
            source.share_selection(SharedSelection(config.index_source(layer_idx)), "source")
        attn.share_selection(source.shared_selection, "reuse")
