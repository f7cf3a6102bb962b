"""The experts' and FFNs' GLU activations for training, forward and backward written out (docs/design.md §1.2, §18).

    swiglu  act = silu(min(g, c)) * clamp(u, -c, c)                       c: the optional clamp
    situ    act = A(g) B(u),  A = b1 tanh(g / b1) sigmoid(g),  B = b2 tanh(u / b2)

Autograd through the plain formulas (`ops.routing.expert_glu`, the twin) takes one node per op and keeps the
intermediates each node's backward reads (g, u and silu(g) for SwiGLU; more for SiTU), then re-walks them.
Here the forward forms act and both slopes at once, from one pass of each transcendental:

  `glu_slopes`    (act, dact/dg, dact/du);
  `FusedGLU`      one autograd node over gate and up that saves the two slopes: its backward is two products;
  `glu_backward`  for callers that keep only the pre-activations (the routed experts' tiles): the slopes
                  recomputed, dL/dg and dL/du written into caller buffers (the two halves of the experts'
                  [r, 2F] gradient, so nothing is concatenated), and act returned for dW2 from the same
                  passes (it was a second recompute).

    SwiGLU:  dact/du = silu(g_c),  dact/dg = u_c silu'(g_c) (aten's silu_backward, one pass); each 0 where
             the clamp cut its input
    SiTU:    dact/dg = B(u) A'(g),  A' = (1 - tanh(g/b1)^2) sigmoid(g) + A(g) (1 - sigmoid(g))
             dact/du = A(g) B'(u),  B' = 1 - tanh(u/b2)^2

Measured (benchmarks/RESULTS.md, issue 44): FusedGLU is ~1.5x faster than the twin for SiTU and at parity for
SwiGLU (the same five elementwise passes either way; it keeps two tensors instead of three); glu_backward is
~1.4x (SwiGLU) and ~2.3x (SiTU) faster than the experts' former derivative plus recompute.

Batch-invariant mode (ops/batch_invariant.py) is inference-only and position-exact: `fused_glu` leaves it,
and any call without gradients, to the plain formulas. tests/test_fused_activation.py compares outputs and
both inputs' gradients with autograd through the twin (ragged shapes, fp64, saturated SiTU, clamped SwiGLU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentmoe_lab.ops import batch_invariant
from latentmoe_lab.ops.activations import check_situ_betas
from latentmoe_lab.ops.routing import expert_glu


def glu_slopes(gate: torch.Tensor, up: torch.Tensor, clamp: float | None = None,
               situ_betas: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act, dact/dgate, dact/dup), each like gate and up [..., F]; no autograd graph. act has the twin's bits."""
    if situ_betas is not None:
        return _situ_slopes(gate, up, *situ_betas)
    clamped_gate, clamped_up = (gate, up) if clamp is None else (gate.clamp(max=clamp), up.clamp(-clamp, clamp))
    up_slope = F.silu(clamped_gate)
    act = up_slope * clamped_up
    gate_slope = torch.ops.aten.silu_backward(clamped_up, clamped_gate)  # u silu'(g) in one pass
    if clamp is not None:  # torch.clamp passes the gradient where its input lies within the bounds
        gate_slope.masked_fill_(gate > clamp, 0.0)
        up_slope.masked_fill_(up.abs() > clamp, 0.0)
    return act, gate_slope, up_slope


def _situ_slopes(gate, up, beta_gate: float, beta_up: float):
    """`glu_slopes` for SiTU (formulas in the module docstring), reusing its intermediates in place."""
    tanh_gate, sig = torch.tanh(gate / beta_gate), torch.sigmoid(gate)
    gate_factor = tanh_gate * beta_gate
    gate_factor.mul_(sig)  # A(g), rounded as the twin's beta_gate * tanh * sigmoid
    tanh_up = torch.tanh(up / beta_up)
    up_factor = tanh_up * beta_up  # B(u)
    act = gate_factor * up_factor
    gate_slope = tanh_gate.square_().neg_().add_(1.0).mul_(sig)  # (1 - tanh^2) sig
    gate_slope.addcmul_(gate_factor, sig.neg_().add_(1.0)).mul_(up_factor)  # + A (1 - sig), times B
    up_slope = tanh_up.square_().neg_().add_(1.0).mul_(gate_factor)  # A B'
    return act, gate_slope, up_slope


def glu_backward(gate: torch.Tensor, up: torch.Tensor, grad_act: torch.Tensor, grad_gate: torch.Tensor,
                 grad_up: torch.Tensor, clamp: float | None = None,
                 situ_betas: tuple[float, float] | None = None) -> torch.Tensor:
    """Write dL/dgate into grad_gate and dL/dup into grad_up (each [..., F], like gate and up; they may be
    views into one buffer) from grad_act (read only); returns act, as the forward had it (for dW2)."""
    act, gate_slope, up_slope = glu_slopes(gate, up, clamp, situ_betas)
    torch.mul(grad_act, gate_slope, out=grad_gate)
    torch.mul(grad_act, up_slope, out=grad_up)
    return act


class FusedGLU(torch.autograd.Function):
    """gate, up [..., F] -> act [..., F]; saves the two slopes only, its backward is two products."""

    @staticmethod
    def forward(ctx, gate, up, clamp, situ_betas):
        act, gate_slope, up_slope = glu_slopes(gate, up, clamp, situ_betas)
        ctx.save_for_backward(gate_slope, up_slope)
        return act

    @staticmethod
    def backward(ctx, grad_act):
        gate_slope, up_slope = ctx.saved_tensors
        return grad_act * gate_slope, grad_act * up_slope, None, None


def fused_glu(gate: torch.Tensor, up: torch.Tensor, clamp: float | None = None,
              situ_betas: tuple[float, float] | None = None) -> torch.Tensor:
    """`ops.routing.expert_glu(gate, up, clamp, situ_betas)` (same arguments, checks and values) as one
    autograd node while gradients are recorded; the plain formulas otherwise, in batch-invariant mode and under
    torch.compile (whose inductor fuses them itself)."""
    recording = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if not recording or batch_invariant.active() or torch.compiler.is_compiling() or gate.shape != up.shape:
        return expert_glu(gate, up, clamp, situ_betas)
    if situ_betas is not None:
        if clamp is not None:
            return expert_glu(gate, up, clamp, situ_betas)  # (raises expert_glu's ValueError)
        check_situ_betas(*situ_betas)
    return FusedGLU.apply(gate, up, clamp, situ_betas)
