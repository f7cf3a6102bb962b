"""Simulated activation quantization for W8A8 (docs/design.md §7): quantize, dequantize, carry on in fp32.

Two kinds of scale:
    dynamic  per token, per group of 128 channels (1 x 128): scale = absmax(group) / qmax, computed on the fly.
             A width that is not a multiple of 128 ends in one smaller group (ceil(I / 128) groups).
    static   one per-tensor scale from calibration (`quant.calibrate`), held as a fp32 buffer; 0 means
             not calibrated yet, and forward refuses to guess.
qmax is 127 for int8 (round to nearest, symmetric) and 448 for fp8 e4m3.
SmoothQuant (optional): x / smooth before quantizing; the weight was packed as W * smooth, so the product is
unchanged while the activation outliers move into the weight (s_j = absmax(x_j)^a / absmax(W_j)^(1 - a)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 128
QMAX = {"int8": 127.0, "fp8": 448.0}
MODES = ("dynamic", "static")


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """x fp32, scale broadcastable to x (> 0) -> x rounded onto the int8 or e4m3 grid of that scale, fp32."""
    qmax = QMAX[dtype]
    scaled = (x / scale).clamp(-qmax, qmax)
    if dtype == "int8":
        return scaled.round() * scale
    return scaled.to(torch.float8_e4m3fn).float() * scale


def quantize_groups(x: torch.Tensor, dtype: str, group: int = GROUP) -> torch.Tensor:
    """Dynamic 1 x group quantization of fp32 x [..., I] -> fp32 [..., I] (ceil(I / group) groups per token)."""
    width = x.shape[-1]
    groups = F.pad(x, (0, (-width) % group)).unflatten(-1, (-1, group))  # [..., ceil(I/g), g]
    scale = groups.abs().amax(dim=-1, keepdim=True) / QMAX[dtype]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
    return fake_quantize(groups, scale, dtype).flatten(-2)[..., :width]


class ActivationQuantizer(nn.Module):
    """x [..., in_features] -> fp32, quantized and dequantized. Buffers: `scale` (static), `smooth` [in_features].

    While `observer` is set (by calibration) the input passes through unquantized and is shown to it.
    """

    def __init__(self, mode: str, dtype: str, in_features: int, smooth: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
        if dtype not in QMAX:
            raise ValueError(f"dtype: activations quantize to one of {sorted(QMAX)}, got {dtype!r}")
        self.mode, self.dtype, self.in_features = mode, dtype, in_features
        if mode == "static":
            self.register_buffer("scale", torch.zeros((), dtype=torch.float32))
        if smooth:
            self.register_buffer("smooth", torch.ones(in_features, dtype=torch.float32))
        self.observer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if hasattr(self, "smooth"):
            x = x / self.smooth
        if self.observer is not None:
            self.observer.observe(x)
            return x
        if self.mode == "dynamic":
            return quantize_groups(x, self.dtype)
        if not self.scale > 0:
            raise ValueError("scale: this static activation quantizer is not calibrated; run "
                             "quant.calibrate(model, batches, method) first")
        return fake_quantize(x, self.scale, self.dtype)

    def _apply(self, fn, recurse=True):
        return keep_fp32_buffers(self, fn, recurse, super()._apply)

    def extra_repr(self) -> str:
        return f"{self.mode} {self.dtype}, in_features={self.in_features}, smooth={hasattr(self, 'smooth')}"


def keep_fp32_buffers(module: nn.Module, fn, recurse: bool, apply) -> nn.Module:
    """Run Module._apply but keep the module's fp32 buffers (scales) in fp32, exactly.

    `model.to(torch.bfloat16)` casts every floating tensor; a bf16 round trip of a scale would shift every
    dequantized value of its block. Device moves still apply. Non-persistent buffers (dtype probes) do follow fn.
    """
    kept = {name: buf for name, buf in module._buffers.items()
            if buf is not None and buf.dtype == torch.float32 and name not in module._non_persistent_buffers_set}
    apply(fn, recurse)
    for name, buf in kept.items():
        module._buffers[name] = buf.to(module._buffers[name].device)
    return module
