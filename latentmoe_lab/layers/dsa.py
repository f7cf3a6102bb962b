"""Gated DSA: DeepSeek Sparse Attention on multi-head latent attention, with a sigmoid output gate (DESIGN 1.4).

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
The sparse path scores and attends in query blocks, so prefill holds [B, block, S] index scores at a time.
Shapes: B batch, T new tokens, S cached + new tokens, H heads; per-head tensors are [B, T, H, D].
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from einops import einsum, rearrange
from torch import nn

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import check_sequence_start
from latentmoe_lab.ops.sparse_attention import (dense_causal_attention, index_scores, index_topk,
                                                sparse_attention)


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

    def scores(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden], c_q: [B, T, q_lora], index_keys: [B, S, DI] -> I [B, T, S] fp32 (not masked)."""
        q_idx, head_weights = self.queries(x, c_q)
        return index_scores(q_idx, index_keys, head_weights)

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


class GatedDSA(nn.Module):
    """forward(x [B, T, hidden], cache=None, absorb=None, dense=False) -> [B, T, hidden].

    query_block: queries scored and attended together in the sparse path (bounds prefill memory).
    """

    def __init__(self, config: ModelConfig, query_block: int = 64):
        super().__init__()
        if not isinstance(query_block, int) or isinstance(query_block, bool) or query_block < 1:
            raise ValueError(f"query_block: expected a positive integer, got {query_block!r}")
        self.query_block = query_block
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
        self.w_gate = nn.Linear(config.hidden_size, mla.num_heads * mla.v_head_dim, bias=False)
        self.wo = nn.Linear(mla.num_heads * mla.v_head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: DSALayerCache | None = None, absorb: bool | None = None,
                dense: bool = False, sequence_start: torch.Tensor | None = None) -> torch.Tensor:
        """Attend the T new tokens over the cache (if given, appended to first) and themselves.

        absorb=None picks the absorbed form for sparse attention (one top-k gather of the latent serves
        every head, instead of one gather of per-head K and V each) and for decode (a cache and T == 1),
        the expanded form for dense multi-token attention.
        dense=True skips the indexer and attends over every causal position (the equality reference).
        sequence_start [B, T] int64 (packed sequences, no cache): position of the first token of each token's
        own sequence; no query sees a key before it.
        """
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
            w_kb, w_vb = rearrange(self.wkv_b.weight, "(h d) c -> h d c", h=self.num_heads).split(
                [self.nope_dim, self.v_head_dim], dim=1)  # [H, nope, kv_lora], [H, v, kv_lora]
            attn = self._attend(*self._absorbed_qkv(q_nope, q_rope, latent_rope, w_kb), x, c_q, index_keys,
                                offset, dense, sequence_start)  # [B, T, H, kv_lora]
            attn = einsum(attn, w_vb, "b t h c, h v c -> b t h v")  # W_vb moves after the softmax
        else:
            attn = self._attend(*self._expanded_qkv(q_nope, q_rope, latent_rope), x, c_q, index_keys, offset, dense,
                                sequence_start)

        gate = torch.sigmoid(rearrange(self.w_gate(x), "b t (h d) -> b t h d", h=self.num_heads))
        return self.wo(rearrange(attn * gate, "b t h d -> b t (h d)"))

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
        return c_q, q_nope, q_rope, self.kv_norm(kv_latent), k_rope, self.indexer.keys(x)

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
        q_latent = einsum(q_nope, w_kb, "b t h n, h n c -> b t h c")
        q = torch.cat([q_latent, q_rope], dim=-1)  # [B, T, H, kv_lora + rope]
        k = latent_rope[:, :, None, :]  # [B, S, 1, kv_lora + rope]
        return q, k, k[..., :self.kv_lora_rank]

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
                  for start, stop, indices in self.indexer.select_blocks(x, c_q, index_keys, offset, self.query_block,
                                                                         first_key)]
        return torch.cat(blocks, dim=1) if blocks else q.new_zeros(*q.shape[:3], v.shape[-1])

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

