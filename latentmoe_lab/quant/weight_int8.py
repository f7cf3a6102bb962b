"""INT8 weights, symmetric, one fp32 scale per output channel (docs/design.md §7).

Byte layout of one weight W [..., O, I] (out, in; stacked experts are packed [E, O, I]):

    data   int8 [..., O, I]   round(W / scale[o]) in [-127, 127] (-128 unused: the grid stays symmetric)
    scale  fp32 [..., O]      scale[o] = absmax(W[o, :]) / 127

Bytes: O * I + 4 * O per matrix. Dequantization error per element <= scale[o] / 2.
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0


class Int8ChannelFormat:
    name = "int8"
    row_tile = 1  # every row carries its own scale, so any row range is a valid tile

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight [..., O, I] float -> {"data": int8 [..., O, I], "scale": fp32 [..., O]}."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=-1) / INT8_MAX
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
        data = (w / divisor).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return {"data": data, "scale": scale}

    def unpack(self, packed: dict[str, torch.Tensor], start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the weight, fp32 [..., stop - start, I]."""
        data, scale = packed["data"], packed["scale"]
        stop = data.shape[-2] if stop is None else stop
        return data[..., start:stop, :].float() * scale[..., start:stop, None]

    def empty(self, shape: tuple[int, ...], device=None) -> dict[str, torch.Tensor]:
        return {"data": torch.empty(shape, dtype=torch.int8, device=device),
                "scale": torch.empty(shape[:-1], device=device)}
