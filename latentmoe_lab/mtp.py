"""Multi-token prediction head (DeepSeek-V3 style, docs/design.md §12): `config.mtp_depth` extra depths.

Depth k (1-based) continues depth k-1 (depth 0 is the main model's last hidden state, before its final norm):

    h_k[t] = Block_k( W_k [RMSNorm(h_{k-1}[t]) ; RMSNorm(E x[t + k])] )      W_k: 2d -> d, no bias
    logits_k[t] = LMHead(RMSNorm_k(h_k[t]))                                  predicts x[t + k + 1]

Block_k is one decoder block with Gated DSA attention (causal over depth k's own positions). Its FFN is a
dense SwiGLU, not LatentMoE: the routing-bias update, the expert-load records and expert placement then
concern the main layers only. E and LMHead are the main model's, shared. Image placeholder tokens enter
through their token embedding (the vision features replace them in the main model only).
Training: mtp_loss = the mean over depths of each depth's cross-entropy; the trainer adds it weighted.
Drafting (serving/spec/): mtp_drafter.py runs one request's depths over a DSALayerCache each; mtp_batched.py
runs every drafting request of a step together over a paged DSAPool per depth.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.paged_pools import DSAPool

IGNORE_INDEX = -100


class MTPDepth(nn.Module):
    """One depth: hidden_norm, embed_norm, proj (2d -> d), a Gated DSA decoder block, an output norm."""

    def __init__(self, config: ModelConfig, depth: int, make_block: Callable[[int], nn.Module]):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = RMSNorm(d, eps)
        self.embed_norm = RMSNorm(d, eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        nn.init.normal_(self.proj.weight, std=config.initializer_range)
        self.block = make_block(config.num_layers + depth - 1)
        self.norm = RMSNorm(d, eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cache: DSALayerCache | None = None,
                sequence_start: torch.Tensor | None = None, batch: ForwardBatch | None = None,
                pool: DSAPool | None = None) -> torch.Tensor:
        """hidden [B, T, d] (depth k-1 at t), next_embeds [B, T, d] (E x[t + k]) -> h_k [B, T, d].

        cache: this depth's DSA cache (drafting); the T rows continue it. sequence_start [B, T]: packed rows.
        batch + pool: the paged form (the batched drafter, serving/spec/mtp_batched.py), B = 1 and T the rows
        of batch's sequences back to back, continuing from this depth's DSAPool.
        """
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embeds)], dim=-1))
        return self.block(x, cache, sequence_start, batch=batch, pool=pool)


class MultiTokenPredictor(nn.Module):
    """config.mtp_depth MTPDepth modules; the embedding and LM head are passed in (the model's own).
    make_block(layer_idx): the model's decoder block with Gated DSA attention and a dense FFN (model.py passes
    it, so this module does not import back up into the model)."""

    def __init__(self, config: ModelConfig, make_block: Callable[[int], nn.Module]):
        super().__init__()
        self.depths = nn.ModuleList(MTPDepth(config, k, make_block) for k in range(1, config.mtp_depth + 1))

    def loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, embed: nn.Embedding,
             lm_head: nn.Linear, sequence_start: torch.Tensor | None = None) -> torch.Tensor:
        """Mean over depths of the (at least fp32) cross-entropy of depth k's logits at t against labels[t + k + 1].

        hidden [B, T, d]: the main model's last hidden state (before its final norm); input_ids, labels [B, T]
        (labels aligned with input_ids, -100 ignored); sequence_start [B, T] (packed rows): a target in
        another sequence than t is ignored, and so is every depth-k input that crosses into one.
        Depth k runs on the first T - k positions (x[t + k] must exist); a depth with none adds 0.
        """
        total = hidden.new_zeros((), dtype=torch.float32)
        for k, depth in enumerate(self.depths, start=1):
            length = input_ids.shape[1] - k
            if length < 1:
                break
            starts = None if sequence_start is None else sequence_start[:, :length]
            hidden = depth(hidden[:, :length], embed(input_ids[:, k:]), sequence_start=starts)
            logits = lm_head(depth.norm(hidden))  # [B, T - k, vocab]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, fp64 stays
            total = total + _depth_loss(logits, labels, k, sequence_start)
        return total / len(self.depths)


def _depth_loss(logits: torch.Tensor, labels: torch.Tensor, k: int,
                sequence_start: torch.Tensor | None) -> torch.Tensor:
    """logits [B, T - k, V] of depth k against labels[:, t + k + 1]; the last position has no target.

    Packed rows: the target is ignored when t + k + 1 lies in a later sequence than t (its sequence
    starts after t); every position whose input crossed into a later sequence has such a target.
    """
    targets = labels[:, k + 1:].long()  # [B, T - k - 1]
    if sequence_start is not None:
        positions = torch.arange(targets.shape[1], device=targets.device)
        targets = targets.masked_fill(sequence_start[:, k + 1:].to(targets.device) > positions, IGNORE_INDEX)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    summed = nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / (targets != IGNORE_INDEX).sum().clamp(min=1)
