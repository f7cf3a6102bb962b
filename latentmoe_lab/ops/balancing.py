"""Load balancing for the sigmoid router (docs/design.md §1.2) and per-step routing statistics.

Shape legend: B sequences, T tokens per sequence, N = B * T tokens, E experts, K experts per token.

    bias update   b_i <- b_i + u * sign(mean(c) - c_i)          c_i: tokens routed to expert i in the step
    quantile rule b_i <- -Q_{1-K/E}(s_{:,i}),  b <- b - mean(b)   K3 (docs/design.md §18): each expert's bias
                  moves to the value whose score threshold lets exactly the share K/E of the batch's tokens
                  through, Q_q being the q-quantile (linear interpolation) of expert i's N scores
    aux loss      L = alpha * sum_i f_i * P_i                    per sequence, then averaged over sequences
                  f_i = E / (K * T) * #{t : i in I_t}            1.0 for every expert under perfect balance
                  P_i = mean_t s_{t,i} / sum_j s_{t,j}           s = sigmoid(logits)
    z-loss        mean_t logsumexp(logits_t)^2                   keeps logits small, so sigmoids stay sensitive

The bias update is a pure function of the counts: it never enters the loss, so it moves the
selection without touching a gradient. f is a count and carries no gradient; the aux loss
reaches the router only through P.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from latentmoe_lab.ops.routing import check_expert_indices, count_routed


def _check_logits(logits: torch.Tensor, dims: int, layout: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != dims:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected {dims} dims {layout}, got shape {shape}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices [N, K] -> tokens routed to each expert [E] int64 (no gradient); routing.count_routed, checked."""
    check_expert_indices(indices, num_experts, 2, "[N, K]")
    return count_routed(indices, num_experts)


def bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """b + rate * sign(mean(c) - c) as a new fp32 tensor [E]: underloaded experts gain, overloaded lose."""
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
        raise ValueError(f"bias: expected 1 dim [E], got {getattr(bias, 'shape', type(bias).__name__)}")
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != tuple(bias.shape):
        shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"counts: expected shape {tuple(bias.shape)} [E], got {shape}")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate < 0:
        raise ValueError(f"rate: must be a finite number >= 0, got {rate!r}")
    load = counts.to(device=bias.device, dtype=torch.float32)
    return bias.detach().float() + rate * torch.sign(load.mean() - load)


def _check_quantile_args(scores: torch.Tensor, top_k: int) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        got = (tuple(scores.shape), scores.dtype) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores: expected a floating tensor of 2 dims [N, E], got {got}")
    if scores.shape[0] < 1:
        raise ValueError(f"scores: need at least one token [N, E], got shape {tuple(scores.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= scores.shape[1]:
        raise ValueError(f"top_k: must be an integer in [1, E={scores.shape[1]}], got {top_k!r}")


def quantile_bias(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The quantile rule's new bias: scores [N, E] (sigmoid router scores of one batch) -> fp32 [E], mean 0.

    b_i = -Q_{1-K/E}(s_{:,i}) then mean-centred: with choice = s + b, expert i's scores clear the common
    threshold -mean(b) on a share K/E of the tokens, its balanced share. A constant added to every bias
    changes no top-k choice, so the centring only keeps the biases near zero. Q interpolates linearly
    between order statistics (torch.quantile's rule), computed by a sort so that N has no size limit.
    """
    _check_quantile_args(scores, top_k)
    ordered = scores.detach().float().sort(dim=0).values  # [N, E] ascending per expert
    position = (1.0 - top_k / scores.shape[1]) * (scores.shape[0] - 1)
    low = int(position)
    high = min(low + 1, scores.shape[0] - 1)
    threshold = ordered[low] + (position - low) * (ordered[high] - ordered[low])
    return threshold.mean() - threshold


def quantile_bias_reference(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Twin of `quantile_bias`: one expert at a time through torch.quantile, centred with a python mean."""
    _check_quantile_args(scores, top_k)
    level = 1.0 - top_k / scores.shape[1]
    raw = [-float(torch.quantile(scores[:, i].detach().double(), level)) for i in range(scores.shape[1])]
    mean = sum(raw) / len(raw)
    return torch.tensor([b - mean for b in raw], dtype=torch.float32)


def sequence_aux_loss(logits: torch.Tensor, indices: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Sequence-wise balance loss. logits [B, T, E], indices [B, T, K] -> scalar fp32.

    Equals alpha when every sequence spreads its tokens evenly and the normalised scores are uniform.
    """
    _check_logits(logits, 3, "[B, T, E]")
    batch, seq_len, num_experts = logits.shape
    check_expert_indices(indices, num_experts, 3, "[B, T, K]")
    if tuple(indices.shape[:2]) != (batch, seq_len):
        raise ValueError(f"indices: expected leading dims ({batch}, {seq_len}) [B, T], got {tuple(indices.shape)}")
    top_k = indices.shape[-1]
    flat = indices.reshape(batch, -1).long()
    counts = torch.zeros(batch, num_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float32))
    f = counts * (num_experts / (top_k * seq_len))  # [B, E], a count: no gradient
    scores = torch.sigmoid(logits.float())
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [B, E]
    return alpha * (f * p).sum(-1).mean()


def sequence_aux_loss_reference(logits: torch.Tensor, indices: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Twin of `sequence_aux_loss`: one sequence and one expert at a time, straight from the formula."""
    _check_logits(logits, 3, "[B, T, E]")
    batch, seq_len, num_experts = logits.shape
    top_k = indices.shape[-1]
    per_sequence = []
    for b in range(batch):
        scores = torch.sigmoid(logits[b].float())
        total = logits.new_zeros((), dtype=torch.float32)
        for i in range(num_experts):
            f_i = num_experts / (top_k * seq_len) * int((indices[b] == i).any(-1).sum())
            p_i = (scores[:, i] / scores.sum(-1)).mean()
            total = total + f_i * p_i
        per_sequence.append(total)
    return alpha * torch.stack(per_sequence).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(logits)^2 in fp32. logits [..., E] -> scalar."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"logits: expected at least 1 dim [..., E], got {getattr(logits, 'shape', logits)!r}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


@dataclass(frozen=True, eq=False)  # holds a tensor: == would be ambiguous
class RoutingStats:
    """What one routing step did to the experts.

    counts:            [E] int64 tokens per expert
    max_over_mean:     busiest expert / mean load; the slowdown of the busiest expert-parallel rank
    min_over_mean:     idlest expert / mean load (0 when an expert got nothing)
    capacity:          rows each expert accepts, ceil(capacity_factor * N * K / E), or None
    dropped_fraction:  routed (token, expert) pairs beyond capacity / all pairs (0 without a capacity)
    load_entropy:      entropy of counts / sum(counts) over log(E): 1 = perfectly even, 0 = one expert
    router_entropy:    mean over tokens of the entropy of s / sum(s) over log(E), or None without logits
    """

    counts: torch.Tensor
    max_over_mean: float
    min_over_mean: float
    capacity: int | None
    dropped_fraction: float
    load_entropy: float
    router_entropy: float | None


def _normalised_entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy along the last dim divided by log(size); p sums to 1 along it (0 log 0 = 0)."""
    size = p.shape[-1]
    if size == 1:
        return torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device)
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1) / math.log(size)


def load_stats(counts: torch.Tensor, capacity_factor: float | None = None,
               logits: torch.Tensor | None = None) -> RoutingStats:
    """Statistics from tokens per expert counts [E] (and logits [N, E], optional, for the router entropy)."""
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.is_floating_point():
        raise ValueError(f"counts: expected 1 dim [E] of integers, got {getattr(counts, 'shape', counts)!r}")
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0):
        raise ValueError(f"capacity_factor: must be None or a number > 0, got {capacity_factor!r}")
    num_experts, pairs = counts.shape[0], int(counts.sum())
    mean = pairs / num_experts
    load = counts.float()
    capacity, dropped = None, 0.0
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * mean)
        dropped = float((counts - capacity).clamp_min(0).sum()) / pairs if pairs else 0.0
    router_entropy = None
    if logits is not None:
        _check_logits(logits, 2, "[N, E]")
        if logits.shape[1] != num_experts:
            raise ValueError(f"logits: expected {num_experts} experts in the last dim [N, E], got {tuple(logits.shape)}")
        scores = torch.sigmoid(logits.detach().float())
        router_entropy = float(_normalised_entropy(scores / scores.sum(-1, keepdim=True)).mean()) if len(scores) else 0.0
    return RoutingStats(
        counts=counts,
        max_over_mean=float(load.max()) / mean if pairs else 0.0,
        min_over_mean=float(load.min()) / mean if pairs else 0.0,
        capacity=capacity,
        dropped_fraction=dropped,
        load_entropy=float(_normalised_entropy(load / pairs)) if pairs else 0.0,
        router_entropy=router_entropy,
    )


def routing_stats(indices: torch.Tensor, num_experts: int, capacity_factor: float | None = None,
                  logits: torch.Tensor | None = None) -> RoutingStats:
    """Statistics of one step. indices [N, K]; logits [N, E] (optional, for the router entropy)."""
    counts = expert_counts(indices, num_experts)
    if isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[0] != indices.shape[0]:
        raise ValueError(f"logits: expected {indices.shape[0]} rows [N, E] like indices, got {tuple(logits.shape)}")
    return load_stats(counts, capacity_factor, logits)
