"""Block Attention Residuals: a softmax mix over depth (arXiv 2603.15031; docs/design.md §18).

Shape legend: S candidates (sources), D hidden, [...] any leading dims (B, T, or N tokens).

    k_i = RMSNorm(v_i) * w            v_i: candidate i [..., D]; w: the RMSNorm weight [D]
    p_i = softmax_i( q . k_i )        q: the learned per-sublayer query [D]; no 1/sqrt(D) scale
    h   = sum_i p_i v_i               the mix is of the raw candidates, not of the normalised keys

Everything runs in at least fp32 (fp64 stays fp64) and the result is rounded once to the candidates'
dtype. The score of each candidate
depends only on that token's own vector, so the mix is per token: nothing in it crosses positions.
`attn_res` stacks the candidates and does the three steps as tensor ops; `attn_res_reference` is its plain
twin, one candidate at a time with an explicit max-shifted softmax. tests/test_ops_attnres.py compares both,
outputs and gradients, with the formula and with FLA's naive reference transcribed independently.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from latentmoe_lab.ops.precision import at_least_fp32


def _check(query: torch.Tensor, residuals: Sequence[torch.Tensor], rms_weight: torch.Tensor, eps: float) -> int:
    """ValueError naming the argument unless the inputs fit the contract; returns D."""
    if isinstance(residuals, torch.Tensor) or not isinstance(residuals, Sequence) or len(residuals) == 0:
        raise ValueError(f"residuals: expected a non-empty sequence of [..., D] tensors, "
                         f"got {type(residuals).__name__}")
    first = residuals[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 1 or not first.is_floating_point():
        raise ValueError(f"residuals: candidate 0 must be a floating tensor [..., D], got {first!r:.80}")
    for i, candidate in enumerate(residuals):
        if (not isinstance(candidate, torch.Tensor) or candidate.shape != first.shape
                or candidate.dtype != first.dtype or candidate.device != first.device):
            got = (tuple(candidate.shape), candidate.dtype) if isinstance(candidate, torch.Tensor) else type(candidate)
            raise ValueError(f"residuals: candidate {i} must match candidate 0 {tuple(first.shape)} {first.dtype} "
                             f"on {first.device}, got {got}")
    hidden = first.shape[-1]
    for name, tensor in (("query", query), ("rms_weight", rms_weight)):
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (hidden,) or not tensor.is_floating_point():
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name}: expected a floating tensor of shape ({hidden},) [D], got {got}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: must be a finite number > 0, got {eps!r}")
    return hidden


def attn_res_weights(query: torch.Tensor, residuals: Sequence[torch.Tensor], rms_weight: torch.Tensor,
                     eps: float = 1e-6) -> torch.Tensor:
    """The depth softmax p: query [D], S candidates [..., D], rms_weight [D] -> [S, ...] in at least fp32."""
    _check(query, residuals, rms_weight, eps)
    values = at_least_fp32(torch.stack(list(residuals)))  # [S, ..., D]
    keys = values * torch.rsqrt(values.square().mean(-1, keepdim=True) + eps) * rms_weight.to(values.dtype)
    return (keys @ query.to(values.dtype)).softmax(0)


def attn_res(query: torch.Tensor, residuals: Sequence[torch.Tensor], rms_weight: torch.Tensor,
             eps: float = 1e-6) -> torch.Tensor:
    """sum_i softmax_i(q . RMSNorm(v_i) w) v_i: query [D], S candidates [..., D], rms_weight [D] -> [..., D].

    The result has the candidates' dtype; one candidate returns itself (p = 1).
    """
    weights = attn_res_weights(query, residuals, rms_weight, eps)  # [S, ...]
    values = at_least_fp32(torch.stack(list(residuals)))
    return (weights.unsqueeze(-1) * values).sum(0).to(residuals[0].dtype)


def attn_res_reference(query: torch.Tensor, residuals: Sequence[torch.Tensor], rms_weight: torch.Tensor,
                       eps: float = 1e-6) -> torch.Tensor:
    """Twin of `attn_res`: one candidate at a time, the softmax written out with its max shift."""
    _check(query, residuals, rms_weight, eps)
    dtype = at_least_fp32(residuals[0]).dtype
    q, w = query.to(dtype), rms_weight.to(dtype)
    scores = []
    for candidate in residuals:
        v = candidate.to(dtype)
        rms = torch.sqrt((v * v).sum(-1) / v.shape[-1] + eps)  # [...]
        scores.append(((v / rms.unsqueeze(-1)) * w * q).sum(-1))
    top = scores[0]
    for score in scores[1:]:
        top = torch.maximum(top, score)
    exps = [torch.exp(score - top) for score in scores]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    out = torch.zeros_like(residuals[0], dtype=dtype)
    for e, candidate in zip(exps, residuals):
        out = out + (e / total).unsqueeze(-1) * candidate.to(dtype)
    return out.to(residuals[0].dtype)
