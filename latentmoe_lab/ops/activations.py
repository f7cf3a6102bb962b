"""sigmoid, silu and softplus; in batch-invariant mode, forms whose value at an element does not depend on
where it sits in the tensor.

Why: torch's CPU kernels for torch.sigmoid, F.silu and F.softplus vectorize the body of each thread's
range and finish its tail by another formula, so the last few elements of a tensor, and those at a
thread's boundary, come out an ulp different. In a serving step the tensor is the whole batch, so a
token's bits would depend on which other requests share its step. Inside
`ops.batch_invariant.batch_invariant_mode()` these functions use only ops that are exact (add, multiply,
reciprocal, where) or vectorized the same everywhere (exp, log1p), which tests/test_batch_invariance.py
checks on ragged slices; outside it they are torch's own kernels (several times faster). Half-precision
inputs are computed in fp32 and rounded once, as torch's kernels do. The backward is the textbook
derivative.

    sigmoid(x)  = 1 / (1 + e)  for x >= 0,  e * (1 / (1 + e))  for x < 0,   e = exp(-|x|) <= 1 (no overflow)
    silu(x)     = x * sigmoid(x)
    softplus(x) = max(x, 0) + log1p(exp(-|x|))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentmoe_lab.ops import batch_invariant
from latentmoe_lab.ops.precision import at_least_fp32


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x32 = at_least_fp32(x)
        e = x32.abs().neg_().exp_()  # exp(-|x|), in (0, 1]
        r = e.add(1.0).reciprocal_()  # 1 / (1 + e)
        y = torch.where(x32 >= 0, r, e.mul_(r))
        ctx.save_for_backward(y)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return (grad * y * (1.0 - y)).to(grad.dtype)


class _Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        x32 = at_least_fp32(x)
        return (x32.clamp(min=0) + x32.abs().neg_().exp_().log1p_()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * _Sigmoid.apply(x)  # d/dx log(1 + e^x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), elementwise, same shape and dtype."""
    return _Sigmoid.apply(x) if batch_invariant.active() else torch.sigmoid(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), elementwise."""
    return x * _Sigmoid.apply(x) if batch_invariant.active() else F.silu(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), elementwise, without overflow."""
    return _Softplus.apply(x) if batch_invariant.active() else F.softplus(x)
