"""Normalisations used across the model, computed in at least fp32 (ops/precision.py) and cast back.

Both are overflow-safe. x^2 overflows fp32 from |x| ~ 1.8e19 (half precision far sooner), and then
the norm came out 0 for the whole row. Each row is first divided by s = max(max|x|, 1), which leaves
the result unchanged,

    x / sqrt(mean(x^2) + eps) = (x / s) / sqrt(mean((x / s)^2) + eps / s^2),

but keeps every square <= 1. s is a constant for autograd (the result does not depend on it, so the
gradient is exactly that of the plain formula), and a row with max|x| <= 1 is computed exactly as the
plain formula.

`rms_norm` and `l2_norm` run that formula as one autograd node with the backward written out (`_RowNorm`):
with n = x r, r = (mean or sum of x^2 + eps)^-1/2, the gradient is

    dL/dx = r (dL/dn - n . reduce(dL/dn * n))        reduce = mean (RMS) or sum (L2), per row

which needs only n and r from the forward; autograd through the formula would keep and revisit every
intermediate (the norms were ~10% of a mini training step). `*_reference` are the plain formulas, their twins.
"""
from __future__ import annotations

import torch

from latentmoe_lab.ops.precision import at_least_fp32


def _row_scale(x32: torch.Tensor) -> torch.Tensor:
    """s = max(max|x|, 1) over the last dim, [..., 1], outside the autograd graph."""
    return x32.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1.0)


def _normalized(x32: torch.Tensor, eps: float, mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x32 [..., D] -> (n = x r [..., D], r [..., 1]) by the overflow-safe formula (no autograd).

    A fused 2-norm reduction (not pow then sum) and in-place scaling keep the passes over x few.
    """
    scale = _row_scale(x32)
    scaled = x32 / scale
    total = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True).pow(2)
    if mean:
        total = total / x32.shape[-1]
    scaled_r = torch.rsqrt(total + eps / scale.pow(2))
    return scaled.mul_(scaled_r), scaled_r / scale


class _RowNorm(torch.autograd.Function):
    """y = n * weight (weight optional), n = x / sqrt(mean or sum of x^2 + eps) over the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float, mean: bool) -> torch.Tensor:
        x32 = at_least_fp32(x)
        normed, r = _normalized(x32, eps, mean)
        ctx.mean, ctx.input_dtype = mean, x.dtype
        ctx.save_for_backward(normed, r, weight)
        y = normed if weight is None else normed * weight.to(x32.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        normed, r, weight = ctx.saved_tensors
        grad = grad.to(normed.dtype)
        grad_weight = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                rows = normed.reshape(-1, normed.shape[-1])
                grad_weight = torch.linalg.vecdot(grad.reshape(rows.shape), rows, dim=0).to(weight.dtype)
            grad = grad * weight.to(normed.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None, None
        projection = torch.linalg.vecdot(grad, normed, dim=-1).unsqueeze(-1)
        if ctx.mean:
            projection = projection / normed.shape[-1]
        grad_x = torch.addcmul(grad, normed, projection, value=-1.0).mul_(r)
        return grad_x.to(ctx.input_dtype), grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim. x: [..., D], weight: [D]."""
    return _RowNorm.apply(x, weight, eps, True)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (KDA's q/k normalisation). x: [..., D]."""
    return _RowNorm.apply(x, None, eps, False)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """rms_norm with autograd through the formula (the twin)."""
    x32 = at_least_fp32(x)
    scale = _row_scale(x32)
    scaled = x32 / scale
    y = scaled * torch.rsqrt(scaled.pow(2).mean(dim=-1, keepdim=True) + eps / scale.pow(2))
    if weight is not None:
        y = y * weight.to(x32.dtype)
    return y.to(x.dtype)


def l2_norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """l2_norm with autograd through the formula (the twin)."""
    x32 = at_least_fp32(x)
    scale = _row_scale(x32)
    scaled = x32 / scale
    return (scaled * torch.rsqrt(scaled.pow(2).sum(dim=-1, keepdim=True) + eps / scale.pow(2))).to(x.dtype)
