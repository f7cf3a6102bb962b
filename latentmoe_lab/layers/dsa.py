"""Gated DSA: DeepSeek Sparse Attention on multi-head latent attention (MLA), with a sigmoid output gate
(docs/design.md §1.4).

    c_q  = RMSNorm(W_qa x)                      q = W_qb c_q -> per head [q_nope | q_rope]
    c_kv = RMSNorm(W_kva x)[:kv_lora]           k_rope = (W_kva x)[kv_lora:]  (NoPE: never rotated, one for all heads)
    [k_nope | v] = W_kvb c_kv per head          K = [k_nope | k_rope], scale = (nope + rope)^-1/2
    S_t  = TopK_{s <= t} sum_j w_tj ReLU(q^I_tj . k^I_s)     (lightning indexer, shared by all heads)
    out  = W_o [ softmax-attention over S_t  *  sigmoid(W_g x) ]

With mla.rope on (DeepSeek-V3.2, docs/design.md §17.9) q_rope and k_rope turn by each token's position
(ops/rotary.py), and so do the index queries' and keys' first rope dims; keys are cached already rotated.

The cache keeps per token only c_kv, k_rope and the index key. Two equal ways to attend over it:
  expanded  - rebuild per-head K, V from the cached latent with W_kvb (cheap for dense multi-token attention);
  absorbed  - fold W_kvb's key half into the query and its value half into the output, and attend
              MQA-style (one shared head of size kv_lora + rope) directly over the cache (decode, and
              the sparse path, where one gather of the selected latent rows serves every head).
The sparse path scores and attends in query blocks, so prefill holds [B, block, S] index scores at a time.
The indexer and index sharing (dsa.index_share_every > 1: a layer replays another's selections, §15.2) live
in dsa_indexer.py; the paged (serving) path, which also walks the keys in ranges of pool blocks so nothing
it holds grows with S, in dsa_paged.py.
Shapes: B batch, T new tokens, S cached + new tokens, H heads; per-head tensors are [B, T, H, D].
"""
from __future__ import annotations

import torch
from einops import einsum, rearrange
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.dsa_indexer import LightningIndexer, SharedSelection
from latentmoe_lab.layers.dsa_paged import forward_paged
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import check_sequence_start
from latentmoe_lab.ops.activations import sigmoid
from latentmoe_lab.ops.rotary import RotaryEmbedding, yarn_softmax_scale
from latentmoe_lab.ops.sparse_attention import dense_causal_attention, sparse_attention
from latentmoe_lab.ops.sparse_attention_masked import masked_form_pays, masked_sparse_attention
from latentmoe_lab.paged_pools import DSAPool


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
        # dsa.use_indexer False (docs/design.md §17): dense causal MLA; every query "selects" all it can see
        self.use_indexer = config.dsa.use_indexer
        # also known to a layer that reuses another's selection (no indexer)
        self.topk = config.indexer.topk if self.use_indexer else config.max_position_embeddings
        self.paged_reads = "blocks"
        self.paged_dense_prefix = True
        mla = config.mla
        self.hidden_size = config.hidden_size
        self.num_heads = mla.num_heads
        self.nope_dim, self.rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = mla.kv_lora_rank, mla.v_head_dim
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        # mla.rope (docs/design.md §17): q_rope and k_rope turn by each token's position, pairs (2i, 2i + 1),
        # before k_rope is cached; YaRN also sharpens the softmax over all dims. None: NoPE.
        self.rotary = RotaryEmbedding.from_config(mla, "interleaved")
        if mla.rope == "yarn":
            self.scale *= yarn_softmax_scale(mla.yarn_factor, mla.yarn_mscale_all_dim)
        eps = config.rms_norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps

        self.mla_q_lora = mla.q_lora_rank is not None
        query_width = mla.num_heads * (self.nope_dim + self.rope_dim)
        if self.mla_q_lora:
            self.wq_a = nn.Linear(config.hidden_size, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, query_width, bias=False)
        else:  # one query projection, no q latent (transformers' q_lora_rank=None)
            self.wq = nn.Linear(config.hidden_size, query_width, bias=False)
        self.wkv_a = nn.Linear(config.hidden_size, mla.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, eps)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, mla.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.indexer = LightningIndexer(config) if self.use_indexer else None
        # index sharing (share_selection): "source" records its selections into shared_selection, "reuse"
        # replays them and has no indexer of its own
        self.selection_role, self.shared_selection, self._replayed = "own", None, 0
        # mla.output_gate False: plain MLA output, W_o attn
        self.w_gate = (nn.Linear(config.hidden_size, mla.num_heads * mla.v_head_dim, bias=False)
                       if mla.output_gate else None)
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
            return forward_paged(self, x, batch, pool, cache, absorb, dense, sequence_start)
        self._check_inputs(x, cache, absorb)
        check_sequence_start(sequence_start, x, cache)
        dense = dense or not self.use_indexer
        if absorb is None:
            absorb = not dense or (cache is not None and x.shape[1] == 1)

        offset = 0 if cache is None else cache.length
        positions = token_positions(x, offset, sequence_start)
        c_q, q_nope, q_rope, latent, k_rope, index_keys = self.project(x, positions)
        if cache is None:
            latent_rope = torch.cat([latent, k_rope], dim=-1)
        else:
            cache.append(latent, k_rope, index_keys)
            latent_rope, index_keys = cache.absorbed_keys, cache.index_keys  # views, no copy of the cache

        if absorb:
            w_kb, w_vb = self._absorb_weights()
            attn = self._attend(*self._absorbed_qkv(q_nope, q_rope, latent_rope, w_kb), x, c_q, index_keys,
                                offset, dense, sequence_start, positions)  # [B, T, H, kv_lora]
            attn = einsum(attn, w_vb, "b t h c, h v c -> b t h v")  # W_vb moves after the softmax
        else:
            attn = self._attend(*self._expanded_qkv(q_nope, q_rope, latent_rope), x, c_q, index_keys, offset, dense,
                                sequence_start, positions)
        return self._gated_output(attn, x)

    def _gated_output(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """attn [B, T, H, v] -> W_o [attn * sigmoid(W_g x)] [B, T, hidden] (W_o attn without an output gate)."""
        if self.w_gate is not None:
            attn = attn * sigmoid(rearrange(self.w_gate(x), "b t (h d) -> b t h d", h=self.num_heads))
        return self.wo(rearrange(attn, "b t h d -> b t (h d)"))

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

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x: [B, T, hidden] -> c_q, q_nope, q_rope ([B, T, H, *]), latent, k_rope and index keys ([B, T, *]).

        Everything forward computes before attention; the last three are what a DSALayerCache stores.
        positions [B or 1, T] int64: each token's position in its sequence, which RoPE turns q_rope, k_rope and
        the index keys by (default 0 .. T-1; unused without RoPE).
        Without a q LoRA (mla.q_lora_rank None) c_q is x itself: only the indexer reads it, and there is none.
        """
        if self.mla_q_lora:
            c_q = self.q_norm(self.wq_a(x))
            q = rearrange(self.wq_b(c_q), "b t (h d) -> b t h d", h=self.num_heads)
        else:
            c_q, q = x, rearrange(self.wq(x), "b t (h d) -> b t h d", h=self.num_heads)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.rotary is not None:
            positions = token_positions(x, 0, None) if positions is None else positions
            q_rope, k_rope = self.rotary(q_rope, positions), self.rotary(k_rope, positions)
        index_keys = (x.new_zeros(*x.shape[:2], 0) if self.indexer is None  # reuse: none
                      else self.indexer.keys(x, positions))
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
    def _attend(self, q, k, v, x, c_q, index_keys, offset, dense, first_key=None, positions=None):
        """Dense causal attention, or sparse attention over the indexer's top-k, one query block at a time.

        positions [B or 1, T]: the queries' positions in their sequences (RoPE on the index queries)."""
        dense = dense or not self.use_indexer
        if dense and first_key is not None:  # every key of the query's own sequence, through the sparse op
            keys = torch.arange(k.shape[1], device=q.device)
            query_pos = torch.arange(q.shape[1], device=q.device)[:, None] + offset
            visible = (keys >= first_key[..., None]) & (keys <= query_pos)  # [B, T, S]
            return self._sparse_attend(q, k, v, torch.where(visible, keys, -1))
        if dense:
            return dense_causal_attention(q, k, v, scale=self.scale, offset=offset)
        blocks = [self._sparse_attend(q[:, start:stop], k, v, indices)
                  for start, stop, indices in self._select_blocks(x, c_q, index_keys, offset, first_key, positions)]
        return torch.cat(blocks, dim=1) if blocks else q.new_zeros(*q.shape[:3], v.shape[-1])

    def _sparse_attend(self, q, k, v, indices):
        """sparse_attention over indices [B, T, kk]; with few keys (training rows, short prompts) its masked twin,
        which scores every key with one product instead of gathering kk rows per query."""
        if masked_form_pays(k.shape[1], indices.shape[-1]):
            return masked_sparse_attention(q, k, v, indices, scale=self.scale)
        return sparse_attention(q, k, v, indices, scale=self.scale)

    def _select_blocks(self, x, c_q, index_keys, offset, first_key, positions=None):
        """(start, stop, positions) per block of query_block queries: LightningIndexer.select_blocks (recorded
        for the layers that reuse it), or, in a reusing layer, the source layer's replayed."""
        if self.indexer is not None:
            for start, stop, selected in self.indexer.select_blocks(x, c_q, index_keys, offset, self.query_block,
                                                                    first_key, positions):
                yield start, stop, self._select(lambda: selected)
            return
        for start in range(0, x.shape[1], self.query_block):
            yield start, min(start + self.query_block, x.shape[1]), self._select(None)

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


def token_positions(x: torch.Tensor, offset: int, sequence_start: torch.Tensor | None) -> torch.Tensor:
    """Positions [1, T] (offset .. offset + T - 1) of x [B, T, *]'s tokens, or [B, T] within their own packed
    sequences (t - sequence_start)."""
    positions = torch.arange(offset, offset + x.shape[1], device=x.device)[None]
    return positions if sequence_start is None else positions - sequence_start.to(x.device)
