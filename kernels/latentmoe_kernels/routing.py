"""Fused sigmoid top-k routing: router logits -> weights, indices, per-expert counts, expert-major order.

Math (docs/design.md §1.2), per token: s = sigmoid(logits), choice = s + bias (optionally only inside the
topk_group best groups, a group scoring the sum of its top-2 choices), I = TopK(choice, K),
w_i = s_i / sum_{j in I} s_j * scaling.

Blocking: one program owns BLOCK_N tokens and holds their whole logit rows [BLOCK_N, E_PAD] in
registers (E = 896 pads to 1024, so BLOCK_N is small). Everything per token happens in that tile:
sigmoid, bias, group limit, then K rounds of "take the row maximum (lowest expert on ties), record it,
mask it out", then renormalisation and scaling.

Permutation: the tile also knows which of its tokens chose each expert, a one-hot mask
[BLOCK_N, E_PAD]. Its column sums are the block's per-expert counts, and an exclusive cumsum down the
token axis ranks every (token, expert) pair among the block's rows for that expert. Turning block
counts into global positions is an exclusive scan over blocks, which is left to torch (a tiny
[num_blocks, E] cumsum); then position = expert start + rows of earlier blocks + rank in block, and one
scatter writes `order`. Rows of one expert keep token order, exactly like a stable sort by expert,
and nothing uses atomics, so the result is deterministic.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# 0/0 guard for the renormalisation: sigmoid underflows to exactly 0 for logits below about -104.
_MIN_SCORE_SUM = tl.constexpr(1e-20)


class RoutingResult(NamedTuple):
    """weights [N, K] fp32, indices [N, K] int64, counts [E] int64, offsets [E] int64 (end of each
    expert's rows), order [N*K] int64 (flat token * K + slot position of each expert-major row)."""

    weights: torch.Tensor
    indices: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, indices_ptr, ranks_ptr, block_counts_ptr,
                  num_tokens, num_experts, scaling,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, E_PAD: tl.constexpr):
    block = tl.program_id(0)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    tile_ok = row_ok[:, None] & col_ok[None, :]

    logits = tl.load(logits_ptr + rows[:, None] * num_experts + cols[None, :], mask=tile_ok, other=0.0)
    scores = tl.sigmoid(logits.to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(col_ok[None, :], choice, float("-inf"))

    if N_GROUP > 1:
        # Group score = top-2 sum inside the group; keep the TOPK_GROUP best groups, -inf elsewhere.
        per_group = num_experts // N_GROUP
        group_of_col = cols // per_group
        groups = tl.arange(0, G_PAD)
        group_score = tl.full([BLOCK_N, G_PAD], float("-inf"), tl.float32)
        for grp in tl.static_range(N_GROUP):
            in_group = (group_of_col == grp)[None, :] & col_ok[None, :]
            masked = tl.where(in_group, choice, float("-inf"))
            top1 = tl.max(masked, axis=1)
            first = tl.min(tl.where(masked == top1[:, None], cols[None, :], E_PAD), axis=1)
            top2 = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), masked), axis=1)
            group_score = tl.where(groups[None, :] == grp, (top1 + top2)[:, None], group_score)
        kept = tl.zeros([BLOCK_N, G_PAD], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            pick = tl.min(tl.where(group_score == best[:, None], groups[None, :], G_PAD), axis=1)
            hit = groups[None, :] == pick[:, None]
            kept = tl.where(hit, 1, kept)
            group_score = tl.where(hit, float("-inf"), group_score)
        eligible = tl.zeros([BLOCK_N, E_PAD], tl.int32)
        for grp in tl.static_range(N_GROUP):
            group_kept = tl.sum(tl.where(groups[None, :] == grp, kept, 0), axis=1)  # [BLOCK_N], 0 or 1
            eligible = tl.where((group_of_col == grp)[None, :] & (group_kept[:, None] > 0), 1, eligible)
        choice = tl.where(eligible > 0, choice, float("-inf"))

    # K rounds of arg-max; ties go to the lower expert id, like the reference twin.
    slots = tl.arange(0, K_PAD)
    picked_ids = tl.zeros([BLOCK_N, K_PAD], tl.int32)
    picked_scores = tl.zeros([BLOCK_N, K_PAD], tl.float32)
    chosen = tl.zeros([BLOCK_N, E_PAD], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        expert = tl.min(tl.where(choice == best[:, None], cols[None, :], E_PAD), axis=1)
        hit = cols[None, :] == expert[:, None]
        picked_ids = tl.where(slots[None, :] == slot, expert[:, None], picked_ids)
        picked_scores = tl.where(slots[None, :] == slot, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None],
                                 picked_scores)
        chosen = tl.where(hit, 1, chosen)
        choice = tl.where(hit, float("-inf"), choice)

    weights = picked_scores
    if RENORMALIZE:
        weights = weights / tl.maximum(tl.sum(weights, axis=1), _MIN_SCORE_SUM)[:, None]
    weights = weights * scaling
    out_ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    out_at = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out_at, weights, mask=out_ok)
    tl.store(indices_ptr + out_at, picked_ids.to(tl.int64), mask=out_ok)

    # Per-block counts and the rank of each pair among this block's rows for its expert.
    chosen = tl.where(row_ok[:, None], chosen, 0)
    tl.store(block_counts_ptr + block * num_experts + cols, tl.sum(chosen, axis=0), mask=col_ok)
    rank_tile = tl.cumsum(chosen, axis=0) - chosen
    ranks = tl.zeros([BLOCK_N, K_PAD], tl.int32)
    for slot in tl.static_range(TOP_K):
        expert = tl.sum(tl.where(slots[None, :] == slot, picked_ids, 0), axis=1)
        rank = tl.sum(tl.where(cols[None, :] == expert[:, None], rank_tile, 0), axis=1)
        ranks = tl.where(slots[None, :] == slot, rank[:, None], ranks)
    tl.store(ranks_ptr + out_at, ranks, mask=out_ok)


def fused_route(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, n_group: int = 1,
                topk_group: int = 1, renormalize: bool = True, scaling: float = 1.0) -> RoutingResult:
    """Route logits [N, E] (any float dtype, computed in fp32) and build the expert-major permutation.

    The caller validates the arguments (latentmoe_lab.ops.routing does); see `RoutingResult`.
    """
    num_tokens, num_experts = logits.shape
    device = logits.device
    e_pad = triton.next_power_of_2(num_experts)
    # Keep the [BLOCK_N, E_PAD] tiles near 2k elements: 2 tokens at E = 1024, 16 at E <= 128.
    block_n = max(1, min(16, 2048 // e_pad))
    num_blocks = triton.cdiv(num_tokens, block_n)

    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    indices = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    ranks = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    block_counts = torch.zeros(num_blocks, num_experts, dtype=torch.int32, device=device)
    if num_tokens:
        bias_arg = bias.contiguous() if bias is not None else logits
        _route_kernel[(num_blocks,)](
            logits.contiguous(), bias_arg, weights, indices, ranks, block_counts, num_tokens, num_experts,
            float(scaling), HAS_BIAS=bias is not None, N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
            TOPK_GROUP=topk_group, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
            RENORMALIZE=bool(renormalize), BLOCK_N=block_n, E_PAD=e_pad)

    # The scan between blocks: where each (block, expert) run of rows starts in the permuted layout.
    block_counts = block_counts.long()
    counts = block_counts.sum(0)
    offsets = counts.cumsum(0)
    run_start = (offsets - counts)[None, :] + block_counts.cumsum(0) - block_counts  # [num_blocks, E]
    block_of_token = torch.arange(num_tokens, device=device)[:, None] // block_n
    position = run_start[block_of_token, indices] + ranks  # [N, K] permuted row of each (token, slot)
    order = torch.empty(num_tokens * top_k, dtype=torch.int64, device=device)
    order[position.reshape(-1)] = torch.arange(num_tokens * top_k, device=device)
    return RoutingResult(weights, indices, counts, offsets, order)
