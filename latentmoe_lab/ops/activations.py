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

`situ` is K3's expert activation (docs/design.md §18), a GLU whose two factors are soft-bounded by tanh:

    situ(g, u) = [b1 tanh(g / b1) sigmoid(g)] * [b2 tanh(u / b2)]      b1 = beta_gate (4), b2 = beta_up (25)

For |g| << b1 the gate factor is silu(g); for large g it saturates at b1, so a large gate can no longer meet a
large up (the job `swiglu`'s clamp does by cutting, done smoothly).
"""
from __future__ import annotations

import math

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


def check_situ_betas(beta_gate, beta_up) -> None:
    """ValueError unless both are finite numbers > 0 (names as `situ`'s arguments)."""
    for name, value in (("beta_gate", beta_gate), ("beta_up", beta_up)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


def situ(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """[beta_gate tanh(gate / beta_gate) sigmoid(gate)] * [beta_up tanh(up / beta_up)]; gate, up [...] -> [...].

    gate and up must have one shape; the result has their dtype. Differentiable through autograd (tanh and
    sigmoid); the grouped-experts path (ops.grouped_experts) writes the same derivative out by hand.
    """
    check_situ_betas(beta_gate, beta_up)
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor) or gate.shape != up.shape:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (gate, up)]
        raise ValueError(f"gate, up: expected tensors of one shape, got {shapes[0]} and {shapes[1]}")
    return beta_gate * torch.tanh(gate / beta_gate) * sigmoid(gate) * (beta_up * torch.tanh(up / beta_up))


def situ_grads(gate: torch.Tensor, up: torch.Tensor, beta_gate: float, beta_up: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two factors of `situ` and their derivatives: (A(g), A'(g), B(u), B'(u)), each like gate / up.

        A(g) = b1 tanh(g/b1) sigmoid(g)      A'(g) = (1 - tanh(g/b1)^2) sigmoid(g) + A(g) (1 - sigmoid(g))
        B(u) = b2 tanh(u/b2)                 B'(u) = 1 - tanh(u/b2)^2
    """
    tanh_gate, sig = torch.tanh(gate / beta_gate), torch.sigmoid(gate)
    gate_factor = beta_gate * tanh_gate * sig
    tanh_up = torch.tanh(up / beta_up)
    return (gate_factor, (1 - tanh_gate.square()) * sig + gate_factor * (1 - sig),
            beta_up * tanh_up, 1 - tanh_up.square())
