"""The lightning indexer of Gated DSA and index sharing across DSA layers (docs/design.md §1.4, §15.2).

    S_t = TopK_{s <= t} sum_j w_tj ReLU(q^I_tj . k^I_s)     (H_I cheap ReLU heads, one index key per token)

LightningIndexer scores and selects; SharedSelection carries one indexer layer's selections, in call order,
to the DSA layers after it that reuse them (dsa.index_share_every > 1); link_shared_indexers wires a model's
layers from the config. Shapes: B batch, T new tokens, S cached + new tokens, HI index heads of size DI.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from einops import rearrange
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.ops.rotary import RotaryEmbedding
from latentmoe_lab.ops.sparse_attention import index_scores, index_topk


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
        # mla.rope: the first qk_rope_head_dim dims of index queries and keys turn by position, pairs
        # (i, i + rope / 2) as DeepSeek-V3.2's indexer has them (keys after k_norm, cached rotated). None: NoPE.
        self.rotary = RotaryEmbedding.from_config(config.mla, "half")

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, (HI,) DI] with its first rope dims turned by positions [B or 1, T] (default 0 .. T-1)."""
        if self.rotary is None:
            return x
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
        rope, rest = x.split([self.rotary.dim, x.shape[-1] - self.rotary.dim], dim=-1)
        return torch.cat([self.rotary(rope, positions), rest], dim=-1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden] -> index keys [B, T, DI] (what the cache stores); positions [B or 1, T] for RoPE."""
        return self._rotated(self.k_norm(self.wk(x)), positions)

    def queries(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden], c_q: [B, T, q_lora] -> index queries [B, T, HI, DI] and head weights [B, T, HI].

        positions [B or 1, T]: the queries' positions, for RoPE (default 0 .. T-1)."""
        q_idx = rearrange(self.wq(c_q), "b t (j d) -> b t j d", j=self.num_heads)
        return self._rotated(q_idx, positions), self.w_heads(x) * self.head_scale

    @record_function("attn.dsa.indexer")
    def scores(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden], c_q: [B, T, q_lora], index_keys: [B, S, DI] -> I [B, T, S] fp32 (not masked)."""
        q_idx, head_weights = self.queries(x, c_q, positions)
        return index_scores(q_idx, index_keys, head_weights)

    @torch.no_grad()  # positions are integers: no gradient flows back through a selection
    @record_function("attn.dsa.indexer")
    def select(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor, offset: int,
               first_key: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden], c_q: [B, T, q_lora], index_keys: [B, S, DI] -> positions [B, T, topk] (-1 pads).

        first_key [B, T]: the earliest key each query may see (packed sequences: its own sequence's start).
        positions [B or 1, T]: the queries' positions in their sequences, for RoPE (default offset + 0 .. T-1).
        """
        if positions is None:
            positions = torch.arange(offset, offset + x.shape[1], device=x.device)[None]
        q_idx, head_weights = self.queries(x, c_q, positions)
        return index_topk(q_idx, index_keys, head_weights, self.topk, offset, first_key)

    def select_blocks(self, x: torch.Tensor, c_q: torch.Tensor, index_keys: torch.Tensor, offset: int,
                      block: int, first_key: torch.Tensor | None = None, positions: torch.Tensor | None = None
                      ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield (start, stop, positions [B, stop - start, topk]) for query blocks of `block` tokens.

        A block scores only the keys it can see (index_keys[:, :offset + stop]), so the scores alive at
        any time are [B, block, S]: O(block * S) memory, not O(T * S). Same positions as one `select`.
        """
        for start in range(0, x.shape[1], block):
            stop = min(start + block, x.shape[1])
            yield start, stop, self.select(x[:, start:stop], c_q[:, start:stop], index_keys[:, :offset + stop],
                                           offset + start, None if first_key is None else first_key[:, start:stop],
                                           None if positions is None else positions[:, start:stop])


class SharedSelection:
    """The top-k selections of one indexer layer's latest forward, in call order, for the DSA layers after it
    that reuse them (dsa.index_share_every > 1, docs/design.md §15.2). Both layers split a forward into the
    same query blocks, decode groups and chunks, so the n-th selection of the source is the reuser's n-th."""

    def __init__(self, source_layer: int):
        self.source_layer, self.entries = source_layer, []

    def record(self, positions: torch.Tensor) -> torch.Tensor:
        self.entries.append(positions)
        return positions


def link_shared_indexers(config: ModelConfig, attentions: list[nn.Module]) -> None:
    """Wire dsa.index_share_every: each DSA layer of `attentions` (config.layer_types order) whose index source
    is another layer reuses that layer's selections (docs/design.md §15.2). A no-op at the default of 1."""
    if not config.dsa.use_indexer:  # dense MLA: no selections to share
        return
    for layer_idx, attn in enumerate(attentions):
        if config.layer_types[layer_idx] != DSA or config.index_source(layer_idx) == layer_idx:
            continue
        source = attentions[config.index_source(layer_idx)]
        if source.shared_selection is None:
            source.share_selection(SharedSelection(config.index_source(layer_idx)), "source")
        attn.share_selection(source.shared_selection, "reuse")
