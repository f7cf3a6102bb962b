"""Latent trade-offs of one Stable LatentMoE layer and what expert parallelism puts on each rank.

All numbers come from a ModelConfig (docs/design.md §1.2). With alpha = d / l:

    one expert        3 * l * inter weights                              shrinks by alpha
    payload / token   K * l values each way (dispatch, then combine)     shrinks by alpha at fixed K
    expert FLOPs      K * 6 * l * inter per token                        (2 FLOPs per multiply-add)
    projections       W_down and W_up: 2 * 2 * d * l per token; none at alpha = 1, a plain MoE

Iso-communication scaling keeps K * l fixed: the config's own (E, K, l) is the reference, and at
alpha the layer gets E * alpha / alpha_cfg experts and K * alpha / alpha_cfg per token, so
16 x 3584 = 8 x 7168 for the full-scale config.

Expert parallelism over `ep` ranks puts E / ep experts on each rank. With T tokens per rank and
uniform routing every rank receives T * K rows; a token's K experts touch on average
ep * (1 - C(E - E/ep, K) / C(E, K)) distinct ranks, which is what a dispatch that sends a token
once per rank (not once per expert) pays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT


def _check_config(config: ModelConfig) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")


def _check_format(weight_format: str) -> None:
    if weight_format not in BITS_PER_WEIGHT:
        raise ValueError(f"weight_format: must be one of {sorted(BITS_PER_WEIGHT)}, got {weight_format!r}")


def _check_positive_ints(name: str, values) -> None:
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name}: must be a non-empty sequence of positive integers, got {values!r}")


@dataclass(frozen=True)
class LatentPoint:
    """One latent size. Bytes use the given weight format and payload bits; FLOPs count 2 per MAC."""

    alpha: int
    latent_size: int
    num_experts: int
    top_k: int
    expert_bytes: float            # one routed expert
    routed_expert_bytes: float     # all routed experts of the layer
    payload_bytes_per_token: float  # dispatch only; combine sends the same back
    expert_flops_per_token: int
    projection_flops_per_token: int


def latent_tradeoff(config: ModelConfig, alphas=(1, 2, 4, 8), iso_communication: bool = True,
                    weight_format: str = "fp8", payload_bits: int = 16) -> list[LatentPoint]:
    """One LatentPoint per alpha. iso_communication=False keeps the config's E and K at every alpha."""
    _check_config(config)
    _check_format(weight_format)
    _check_positive_ints("alphas", list(alphas))
    if isinstance(payload_bits, bool) or not isinstance(payload_bits, int) or payload_bits < 1:
        raise ValueError(f"payload_bits: must be a positive integer, got {payload_bits!r}")
    hidden, moe = config.hidden_size, config.moe
    alpha_cfg = Fraction(hidden, moe.latent_size)
    points = []
    for alpha in alphas:
        if hidden % alpha:
            raise ValueError(f"alphas: {alpha} does not divide hidden_size {hidden}")
        scale = Fraction(alpha) / alpha_cfg if iso_communication else Fraction(1)
        experts, top_k = moe.num_experts * scale, moe.top_k * scale
        if experts.denominator != 1 or top_k.denominator != 1:
            raise ValueError(f"alphas: {alpha} scales E={moe.num_experts}, K={moe.top_k} of alpha "
                             f"{alpha_cfg} to non-integers ({experts}, {top_k})")
        latent = hidden // alpha
        expert_weights = 3 * latent * moe.expert_intermediate_size
        expert_bytes = expert_weights * BITS_PER_WEIGHT[weight_format] / 8
        points.append(LatentPoint(
            alpha=alpha, latent_size=latent, num_experts=int(experts), top_k=int(top_k),
            expert_bytes=expert_bytes, routed_expert_bytes=expert_bytes * int(experts),
            payload_bytes_per_token=int(top_k) * latent * payload_bits / 8,
            expert_flops_per_token=int(top_k) * 6 * latent * moe.expert_intermediate_size,
            projection_flops_per_token=0 if latent == hidden else 4 * hidden * latent,
        ))
    return points


def iso_communication(config: ModelConfig) -> dict:
    """The config's K x l next to the plain MoE (alpha = 1) it matches: equal payload per token."""
    _check_config(config)
    base = latent_tradeoff(config, alphas=(1,))[0]
    return {"latent_top_k": config.moe.top_k, "latent_size": config.moe.latent_size,
            "latent_product": config.moe.top_k * config.moe.latent_size,
            "base_top_k": base.top_k, "hidden_size": config.hidden_size,
            "base_product": base.top_k * config.hidden_size}


@dataclass(frozen=True)
class RankLoad:
    """Per-rank view of one MoE layer under expert parallelism, uniform routing, T tokens per rank."""

    ep: int
    experts_per_rank: int
    tokens_per_rank: int
    rows_per_rank: int              # routed (token, expert) rows each rank's experts process
    rows_per_expert: float
    ranks_per_token: float          # expected distinct ranks a token's top-k touches
    send_bytes_per_copy: float      # one latent copy per (token, expert) leaving the rank
    send_bytes_per_rank_dedup: float  # one latent copy per (token, remote rank)
    expert_weight_bytes: float      # routed expert weights each rank holds for this layer


def _expected_ranks(num_experts: int, top_k: int, ep: int) -> float:
    """ep * P(a rank holds at least one of the K experts) for K distinct experts drawn uniformly."""
    per_rank = num_experts // ep
    miss = math.comb(num_experts - per_rank, top_k) / math.comb(num_experts, top_k)
    return ep * (1 - miss)


def expert_parallel_ranks(config: ModelConfig, ep_sizes=(8, 64, 128), tokens_per_rank: int = 4096,
                          weight_format: str = "fp8", payload_bits: int = 16) -> list[RankLoad]:
    """One RankLoad per expert-parallel size; each size must divide moe.num_experts."""
    _check_config(config)
    _check_format(weight_format)
    _check_positive_ints("ep_sizes", list(ep_sizes))
    _check_positive_ints("tokens_per_rank", [tokens_per_rank])
    moe = config.moe
    value_bytes = payload_bits / 8
    loads = []
    for ep in ep_sizes:
        if moe.num_experts % ep:
            raise ValueError(f"ep_sizes: {ep} does not divide moe.num_experts {moe.num_experts}")
        ranks = _expected_ranks(moe.num_experts, moe.top_k, ep)
        own_rank = ranks / ep  # probability that the token's own rank is among them
        per_expert = 3 * moe.latent_size * moe.expert_intermediate_size * BITS_PER_WEIGHT[weight_format] / 8
        loads.append(RankLoad(
            ep=ep, experts_per_rank=moe.num_experts // ep, tokens_per_rank=tokens_per_rank,
            rows_per_rank=tokens_per_rank * moe.top_k,
            rows_per_expert=tokens_per_rank * moe.top_k * ep / moe.num_experts,
            ranks_per_token=ranks,
            send_bytes_per_copy=tokens_per_rank * moe.top_k * (ep - 1) / ep * moe.latent_size * value_bytes,
            send_bytes_per_rank_dedup=tokens_per_rank * (ranks - own_rank) * moe.latent_size * value_bytes,
            expert_weight_bytes=per_expert * (moe.num_experts // ep),
        ))
    return loads
