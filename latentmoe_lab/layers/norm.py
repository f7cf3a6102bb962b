"""RMSNorm module over `ops.norms.rms_norm` (overflow-safe: rows of magnitude 1e30 normalise correctly)."""
from __future__ import annotations

import torch
from torch import nn

from latentmoe_lab.ops.norms import rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim. x: [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
