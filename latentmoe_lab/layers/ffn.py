"""SwiGLU feed-forward: the dense FFN layers and the shared experts of the MoE layers (SiTU as K3 has them)."""
from __future__ import annotations

import torch
from torch import nn

from latentmoe_lab.ops.activations import check_situ_betas
from latentmoe_lab.ops.fused_glu import fused_glu


class SwiGLU(nn.Module):
    """y = W2( silu(W1 x) * (W3 x) ), no biases. x: [..., hidden] -> [..., hidden].

    activation_clamp c (shared experts, docs/design.md §1.2): silu(min(W1 x, c)) * clamp(W3 x, -c, c).
    situ_betas (beta_gate, beta_up): the product is situ(W1 x, W3 x) instead (K3's shared experts, §18).
    The activation is `ops.fused_glu.fused_glu`: the plain formulas' values, one autograd node in training.
    """

    def __init__(self, hidden: int, intermediate: int, activation_clamp: float | None = None,
                 situ_betas: tuple[float, float] | None = None):
        super().__init__()
        for name, value in (("hidden", hidden), ("intermediate", intermediate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if activation_clamp is not None and (isinstance(activation_clamp, bool) or
                                             not isinstance(activation_clamp, (int, float)) or
                                             not activation_clamp > 0):
            raise ValueError(f"activation_clamp: must be a positive number or None, got {activation_clamp!r}")
        if situ_betas is not None:
            if activation_clamp is not None:
                raise ValueError("activation_clamp: must be None with situ_betas (SiTU bounds its factors itself)")
            if not isinstance(situ_betas, tuple) or len(situ_betas) != 2:
                raise ValueError(f"situ_betas: expected (beta_gate, beta_up) or None, got {situ_betas!r}")
            check_situ_betas(*situ_betas)
        self.hidden = hidden
        self.activation_clamp = activation_clamp
        self.situ_betas = situ_betas
        self.w1 = nn.Linear(hidden, intermediate, bias=False)  # gate
        self.w3 = nn.Linear(hidden, intermediate, bias=False)  # up
        self.w2 = nn.Linear(intermediate, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected last dim {self.hidden} [..., hidden], got shape {tuple(x.shape)}")
        return self.w2(fused_glu(self.w1(x), self.w3(x), self.activation_clamp, self.situ_betas))
