"""QuantLinear: an nn.Linear whose weight is held packed (fp8 / int8 / mxfp4) and dequantized tile by tile.

    forward(x [..., I]) -> [..., O] in x's dtype:
        x32 = act(x) or x.float()                     optional W8A8 activation quantization (quant/activations.py)
        for each tile of TILE_ROWS output rows:       only that tile of W is ever dequantized (fp32)
            y[:, tile] = x32 @ dequant(W[tile]).T     fp32 accumulation
The twin `reference_forward` dequantizes the whole weight, then one plain matmul (docs/design.md §7).
Buffers: weight_data, weight_scale (layouts in weight_fp8.py / weight_int8.py / weight_mxfp4.py) and the
activation quantizer's scale / smooth. `weight` still reads as a dense tensor (dequantized, in the model's
dtype) for code that uses W directly, such as the absorbed MLA path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentmoe_lab.quant.activations import ActivationQuantizer, keep_fp32_buffers
from latentmoe_lab.quant.weight_fp8 import Fp8BlockFormat
from latentmoe_lab.quant.weight_int8 import Int8ChannelFormat
from latentmoe_lab.quant.weight_mxfp4 import MXFP4Format

WEIGHT_FORMATS = {f.name: f for f in (Fp8BlockFormat(), Int8ChannelFormat(), MXFP4Format())}
TILE_ROWS = 512  # a multiple of every format's row_tile (128 for fp8)


def weight_format(name: str):
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"format: must be one of {sorted(WEIGHT_FORMATS)}, got {name!r}")
    return WEIGHT_FORMATS[name]


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: str, activation: ActivationQuantizer | None = None,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.format = weight_format(fmt)
        for key, tensor in self.format.empty((out_features, in_features), device).items():
            self.register_buffer(f"weight_{key}", tensor)
        self.activation = activation
        # Zero bytes; `model.to(dtype)` casts it, so it remembers the dtype `weight` should read back in.
        self.register_buffer("_dtype_probe", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, activation: ActivationQuantizer | None = None
                    ) -> "QuantLinear":
        """Pack linear.weight (times activation.smooth per input channel, when smoothing). No bias."""
        if linear.bias is not None:
            raise ValueError("linear: QuantLinear packs bias-free layers only (every linear of the model is)")
        module = cls(linear.in_features, linear.out_features, fmt, activation, linear.weight.dtype,
                     linear.weight.device)
        weight = linear.weight.detach().float()
        if activation is not None and hasattr(activation, "smooth"):
            weight = weight * activation.smooth
        for key, tensor in module.format.pack(weight).items():
            setattr(module, f"weight_{key}", tensor)  # replaces the registered (empty) buffer
        return module

    @property
    def packed(self) -> dict[str, torch.Tensor]:
        return {"data": self.weight_data, "scale": self.weight_scale}

    def dequantized_weight(self) -> torch.Tensor:
        """[O, I] fp32 (the weight as packed: times smooth, when smoothing)."""
        return self.format.unpack(self.packed)[:, :self.in_features]

    @property
    def weight(self) -> torch.Tensor:
        """[O, I] in the model's dtype, the original W (smoothing divided back out)."""
        weight = self.dequantized_weight()
        if self.activation is not None and hasattr(self.activation, "smooth"):
            weight = weight / self.activation.smooth
        return weight.to(self._dtype_probe.dtype)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected last dim {self.in_features} [..., in_features], got shape {tuple(x.shape)}")
        return x.float() if self.activation is None else self.activation(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self._input(x).reshape(-1, self.in_features)
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, TILE_ROWS):
            stop = min(start + TILE_ROWS, self.out_features)
            tile = self.format.unpack(self.packed, start, stop)[:, :self.in_features]
            out[:, start:stop] = flat @ tile.T
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Twin of forward: dequantize everything, then the plain matmul."""
        return F.linear(self._input(x), self.dequantized_weight()).to(x.dtype)

    def _apply(self, fn, recurse=True):
        return keep_fp32_buffers(self, fn, recurse, super()._apply)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.name}"
