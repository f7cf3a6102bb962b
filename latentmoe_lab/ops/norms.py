"""Normalisations used across the model, computed in fp32 and cast back."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim. x: [..., D], weight: [D]."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (KDA's q/k normalisation). x: [..., D]."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)
