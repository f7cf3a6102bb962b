"""SwiGLU feed-forward: the dense FFN layers and the shared experts of the MoE layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """y = W2( silu(W1 x) * (W3 x) ), no biases. x: [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        for name, value in (("hidden", hidden), ("intermediate", intermediate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        self.hidden = hidden
        self.w1 = nn.Linear(hidden, intermediate, bias=False)  # gate
        self.w3 = nn.Linear(hidden, intermediate, bias=False)  # up
        self.w2 = nn.Linear(intermediate, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected last dim {self.hidden} [..., hidden], got shape {tuple(x.shape)}")
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
