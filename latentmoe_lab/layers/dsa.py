"""Gated DSA: DeepSeek Sparse Attention on multi-head latent attention, with a sigmoid output gate (DESIGN 1.4).

    c_q  = RMSNorm(W_qa x)                      q = W_qb c_q -> per head [q_nope | q_rope]
    c_kv = RMSNorm(W_kva x)[:kv_lora]           k_rope = (W_kva x)[kv_lora:]  (NoPE: never rotated, one for all heads)
    [k_nope | v] = W_kvb c_kv per head          K = [k_nope | k_rope], scale = (nope + rope)^-1/2
    S_t  = TopK_{s <= t} sum_j w_tj ReLU(q^I_tj . k^I_s)     (lightning indexer, shared by all heads)
    out  = W_o [ softmax-attention over S_t  *  sigmoid(W_g x) ]

The cache keeps per token only c_kv, k_rope and the index key. Two equal ways to attend over it:
  expanded  - rebuild per-head K, V from the cached latent with W_kvb (cheap for long query chunks);
  absorbed  - fold W_kvb's key half into the query and its value half into the output, and attend
              MQA-style (one shared head of size kv_lora + rope) directly over the cache (decode).
Shapes: B batch, T new tokens, S cached + new tokens, H heads; per-head tensors are [B, T, H, D].
"""
from __future__ import annotations

import torch
from einops import einsum, rearrange
from torch import nn

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.ops.sparse_attention import (dense_causal_attention, index_scores, select_topk,
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

    def select(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor, offset: int) -> torch.Tensor:
        """x: [B, T, hidden], c_q: [B, T, q_lora], index_keys: [B, S, DI] -> positions [B, T, topk] (-1 pads)."""
        q_idx = rearrange(self.wq(c_q), "b t (j d) -> b t j d", j=self.num_heads)
        head_weights = self.w_heads(x) * self.head_scale
        return select_topk(index_scores(q_idx, index_keys, head_weights), self.topk, offset)


class GatedDSA(nn.Module):
    """forward(x [B, T, hidden], cache=None, absorb=None, dense=False) -> [B, T, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
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
                dense: bool = False) -> torch.Tensor:
        """Attend the T new tokens over the cache (if given, appended to first) and themselves.

        absorb=None picks the absorbed form for decode (a cache and T == 1), the expanded form otherwise.
        dense=True skips the indexer and attends over every causal position (the equality reference).
        """
        self._check_inputs(x, cache, absorb)
        if absorb is None:
            absorb = cache is not None and x.shape[1] == 1

        c_q = self.q_norm(self.wq_a(x))
        q = rearrange(self.wq_b(c_q), "b t (h d) -> b t h d", h=self.num_heads)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(kv_latent)
        index_keys = self.indexer.keys(x)

        offset = 0
        if cache is not None:
            offset = cache.length
            cache.append(latent, k_rope, index_keys)
            latent, k_rope, index_keys = cache.latent, cache.k_rope, cache.index_keys

        indices = None if dense else self.indexer.select(x, c_q, index_keys, offset)
        attend = self._attend_absorbed if absorb else self._attend_expanded
        attn = attend(q_nope, q_rope, latent, k_rope, indices, offset)  # [B, T, H, v_head_dim]

        gate = torch.sigmoid(rearrange(self.w_gate(x), "b t (h d) -> b t h d", h=self.num_heads))
        return self.wo(rearrange(attn * gate, "b t h d -> b t (h d)"))

    # ------------------------------------------------------------------------------ attention forms
    def _attend_expanded(self, q_nope, q_rope, latent, k_rope, indices, offset):
        """Per-head K = [k_nope | k_rope], V from W_kvb over the latent. latent: [B, S, kv_lora]; k_rope: [B, S, rope]."""
        kv = rearrange(self.wkv_b(latent), "b s (h d) -> b s h d", h=self.num_heads)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k_rope_heads = k_rope[:, :, None, :].expand(-1, -1, self.num_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope_heads], dim=-1)
        return self._attend(q, k, v, indices, offset)

    def _attend_absorbed(self, q_nope, q_rope, latent, k_rope, indices, offset):
        """MQA over the cache: q_nope . (W_kb c_kv) = (q_nope W_kb) . c_kv, and W_vb moves after the softmax."""
        w_kvb = rearrange(self.wkv_b.weight, "(h d) c -> h d c", h=self.num_heads)
        w_kb, w_vb = w_kvb.split([self.nope_dim, self.v_head_dim], dim=1)  # [H, nope, c], [H, v, c]
        q_latent = einsum(q_nope, w_kb, "b t h n, h n c -> b t h c")
        q = torch.cat([q_latent, q_rope], dim=-1)  # [B, T, H, kv_lora + rope]
        k = torch.cat([latent, k_rope], dim=-1)[:, :, None, :]  # [B, S, 1, kv_lora + rope]
        attn_latent = self._attend(q, k, latent[:, :, None, :], indices, offset)  # [B, T, H, kv_lora]
        return einsum(attn_latent, w_vb, "b t h c, h v c -> b t h v")

    def _attend(self, q, k, v, indices, offset):
        if indices is None:
            return dense_causal_attention(q, k, v, scale=self.scale, offset=offset)
        return sparse_attention(q, k, v, indices, scale=self.scale)

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
