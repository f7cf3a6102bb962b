"""Normalisations used across the model, computed in at least fp32 (ops/precision.py) and cast back.

Both are overflow-safe. x^2 overflows fp32 from |x| ~ 1.8e19 (half precision far sooner), and then
the norm came out 0 for the whole row. Each row is first divided by s = max(max|x|, 1), which leaves
the result unchanged,

    x / sqrt(mean(x^2) + eps) = (x / s) / sqrt(mean((x / s)^2) + eps / s^2),

but keeps every square <= 1. s is a constant for autograd (the result does not depend on it, so the
gradient is exactly that of the plain formula), and a row with max|x| <= 1 is computed exactly as the
plain formula.
"""
from __future__ import annotations

import torch

from latentmoe_lab.ops.precision import at_least_fp32


def _row_scale(x32: torch.Tensor) -> torch.Tensor:
    """s = max(max|x|, 1) over the last dim, [..., 1], outside the autograd graph."""
    return x32.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1.0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim. x: [..., D], weight: [D]."""
    x32 = at_least_fp32(x)
    scale = _row_scale(x32)
    scaled = x32 / scale
    y = scaled * torch.rsqrt(scaled.pow(2).mean(dim=-1, keepdim=True) + eps / scale.pow(2))
    if weight is not None:
        y = y * weight.to(x32.dtype)
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (KDA's q/k normalisation). x: [..., D]."""
    x32 = at_least_fp32(x)
    scale = _row_scale(x32)
    scaled = x32 / scale
    return (scaled * torch.rsqrt(scaled.pow(2).sum(dim=-1, keepdim=True) + eps / scale.pow(2))).to(x.dtype)
