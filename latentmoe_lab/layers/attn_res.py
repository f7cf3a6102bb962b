"""Block Attention Residuals in the decoder stack (arXiv 2603.15031; docs/design.md §18).

With `config.attn_res_block_size` = N the residual stream is no longer one running sum. What flows from
layer to layer is an `AttnResStream`:

    blocks   (embedding, block 1, ..., block b)   finished: block j = the sum of the sublayer outputs of
                                                  layers (j-1)N .. jN-1; the embedding is block 0
    partial  the current block's running sum of sublayer outputs (None right after a boundary)

Before the attention and before the MLP of every layer, the sublayer's input is `DepthMix` over the
candidates blocks + (partial, when it has anything): softmax_i(q . RMSNorm(v_i)) mixed v_i, with the
sublayer's own learned query q and RMSNorm weight. The usual pre-norm follows the mix. A block ends
before the attention of layers N, 2N, ...: the partial sum joins the blocks and restarts empty. After the
last layer one more mix (the model's `attn_res_final`) gives the hidden state that the final norm reads.

Every candidate is a function of the token's own vectors, so the mix is per token: a decode step, a
prefill chunk or a pipeline stage holds exactly the stream of the tokens it runs, and nothing of it is
kept from one step to the next (the caches hold only attention state, as without AttnRes).
A pipeline cut after layer j moves `stream_width(j, N)` hidden-size vectors per token instead of one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from latentmoe_lab.ops.attnres import attn_res, attn_res_weights


def stream_width(layers_done: int, block_size: int) -> int:
    """How many [hidden] vectors per token the stream holds after `layers_done` layers (blocks + partial):
    1 before the first layer (the embedding), then 2 + (layers_done - 1) // block_size."""
    if layers_done < 0 or block_size < 1:
        raise ValueError(f"layers_done, block_size: need >= 0 and >= 1, got {layers_done}, {block_size}")
    return 1 if layers_done == 0 else 2 + (layers_done - 1) // block_size


@dataclass(frozen=True, eq=False)  # holds tensors: == would be ambiguous
class AttnResStream:
    """The residual stream of Block AttnRes: finished blocks (embedding first), the current partial sum."""

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None = None

    @classmethod
    def start(cls, embedding: torch.Tensor) -> "AttnResStream":
        return cls(blocks=(embedding,))

    def candidates(self) -> list[torch.Tensor]:
        """The mix's sources in order: blocks, then the partial sum if it has anything."""
        return [*self.blocks, *(() if self.partial is None else (self.partial,))]

    def latest(self) -> torch.Tensor:
        """The newest tensor (partial sum, else the last block): what a finiteness check looks at."""
        return self.blocks[-1] if self.partial is None else self.partial

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "AttnResStream":
        """The same stream with fn applied to every tensor (slicing rows, moving devices)."""
        return AttnResStream(tuple(fn(b) for b in self.blocks), None if self.partial is None else fn(self.partial))

    def pack(self) -> torch.Tensor:
        """One tensor [S, ...] of the candidates, for a pipeline send (S = `stream_width` at the cut)."""
        return torch.stack(self.candidates())

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "AttnResStream":
        """Inverse of `pack` for a stream after at least one layer (the last entry is the partial sum)."""
        if packed.dim() < 2 or packed.shape[0] < 2:
            raise ValueError(f"packed: expected [S >= 2, ..., hidden] (blocks + partial), got {tuple(packed.shape)}")
        return cls(blocks=tuple(packed[:-1].unbind(0)), partial=packed[-1])


def stream_tensor(x: "torch.Tensor | AttnResStream") -> torch.Tensor:
    """x itself for a plain residual stream, the newest tensor of an AttnResStream (finiteness checks)."""
    return x.latest() if isinstance(x, AttnResStream) else x


class DepthMix(nn.Module):
    """One AttnRes mix: a learned query [hidden] (zero at start: the plain mean of the candidates) and an
    RMSNorm weight [hidden] for the keys. candidates: S tensors [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden))
        self.norm_weight = nn.Parameter(torch.ones(hidden))

    def forward(self, candidates: list[torch.Tensor]) -> torch.Tensor:
        return attn_res(self.query, candidates, self.norm_weight, self.eps)

    def weights(self, candidates: list[torch.Tensor]) -> torch.Tensor:
        """The softmax over the candidates [S, ...] (for plots: AttnRes weights over depth)."""
        return attn_res_weights(self.query, candidates, self.norm_weight, self.eps)


class BlockAttnRes(nn.Module):
    """A layer's two mixes (before attention, before the MLP) and its place in the block structure."""

    def __init__(self, hidden: int, eps: float, layer_idx: int, block_size: int):
        super().__init__()
        self.starts_block = layer_idx > 0 and layer_idx % block_size == 0
        self.attn = DepthMix(hidden, eps)
        self.mlp = DepthMix(hidden, eps)

    def run(self, stream: AttnResStream, attention: Callable[[torch.Tensor], torch.Tensor],
            mlp: Callable[[torch.Tensor], torch.Tensor]) -> AttnResStream:
        """The layer on a stream: attention and mlp take the mixed input [..., hidden] (they apply the
        pre-norms) and return the sublayer's output, which joins the partial sum."""
        if not isinstance(stream, AttnResStream):
            raise TypeError(f"stream: expected an AttnResStream, got {type(stream).__name__}")
        blocks, partial = stream.blocks, stream.partial
        if self.starts_block and partial is not None:
            blocks, partial = (*blocks, partial), None
        out = attention(self.attn([*blocks, *(() if partial is None else (partial,))]))
        partial = out if partial is None else partial + out
        partial = partial + mlp(self.mlp([*blocks, partial]))
        return AttnResStream(blocks, partial)
