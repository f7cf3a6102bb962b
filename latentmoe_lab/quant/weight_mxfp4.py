"""MXFP4 weights (OCP Microscaling v1.0): blocks of 32 along the input dim, one E8M0 scale, E2M1 values.

Byte layout of one weight W [..., O, I] (out, in; stacked experts are packed [E, O, I]), nb = ceil(I / 32):

    data   uint8 [..., O, nb * 16]   E2M1 codes, two per byte: element 2j in the low nibble, 2j + 1 in the high one
    scale  uint8 [..., O, nb]        E8M0 biased exponent e: the block's scale is 2^(e - 127) (255 = NaN, unused)

Bytes: O * ceil(I / 32) * 17 per matrix. A ragged last block (I not a multiple of 32) is zero-padded to 32
values; the padding dequantizes to 0 and is cut off by `unpack`.

E2M1 code (sign, 2 exponent bits, 1 mantissa bit): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Quantizing a block:
    X = 2^(floor(log2(absmax)) - 2)        (2 = emax of E2M1, so absmax / X lies in [4, 8))
    v = round_to_nearest_even_E2M1(W / X)  saturating at +-6, as the spec allows
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32
E2M1_EMAX = 2
E8M0_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of each 3-bit code


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by the block scale -> uint8 codes 0..15 (bit 3 = sign).

    Round to nearest, a tie to the even code. The grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6, and
    inside each range the code is an affine function of value / spacing with the same parity, so
    torch.round (half to even) on value / spacing rounds exactly as the spec asks.
    """
    magnitude = values.abs().clamp(max=E2M1_MAGNITUDES[-1])
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    steps = torch.round(magnitude / spacing)  # 4 steps of 0.5 (or of 1.0) lands on the next range's start
    rounded = steps * spacing
    code = torch.where(rounded < 2, rounded * 2, torch.where(rounded < 4, rounded + 2, rounded / 2 + 4))
    sign = (values < 0).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 values."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), device=codes.device)
    return table[codes.long()]


def e8m0_encode(absmax: torch.Tensor) -> torch.Tensor:
    """Block absmax fp32 -> biased exponent uint8 of X = 2^(floor(log2 absmax) - 2); 0 for an all-zero block."""
    _, exponent = torch.frexp(absmax)  # absmax = m * 2^exponent, m in [0.5, 1): floor(log2) = exponent - 1
    biased = exponent.long() - 1 - E2M1_EMAX + E8M0_BIAS
    return torch.where(absmax > 0, biased.clamp(0, 254), torch.zeros_like(biased)).to(torch.uint8)


def e8m0_decode(biased: torch.Tensor) -> torch.Tensor:
    """Biased exponent uint8 -> fp32 scale 2^(e - 127) (2^-127 is a subnormal fp32, still exact)."""
    return torch.ldexp(torch.ones_like(biased, dtype=torch.float32), biased.long() - E8M0_BIAS)


class MXFP4Format:
    name = "mxfp4"
    row_tile = 1  # blocks run along the input dim, so any row range is a valid tile

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight [..., O, I] float -> {"data": uint8 [..., O, nb*16], "scale": uint8 [..., O, nb]}."""
        w = weight.detach().float()
        blocks = F.pad(w, (0, (-w.shape[-1]) % BLOCK)).unflatten(-1, (-1, BLOCK))  # [..., O, nb, 32]
        scale = e8m0_encode(blocks.abs().amax(dim=-1))
        codes = e2m1_encode(blocks / e8m0_decode(scale)[..., None]).flatten(-2)
        return {"data": codes[..., 0::2] | (codes[..., 1::2] << 4), "scale": scale}

    def unpack(self, packed: dict[str, torch.Tensor], start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop, fp32 [..., stop - start, nb * 32]: a ragged last block keeps its zero padding
        (the caller cuts it to I)."""
        data, scale = packed["data"][..., start:stop, :], packed["scale"][..., start:stop, :]
        codes = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)  # [..., rows, nb * 32]
        values = e2m1_decode(codes).unflatten(-1, (-1, BLOCK)) * e8m0_decode(scale)[..., None]
        return values.flatten(-2)

    def empty(self, shape: tuple[int, ...], device=None) -> dict[str, torch.Tensor]:
        *lead, rows, cols = shape
        blocks = _ceil_div(cols, BLOCK)
        return {"data": torch.empty(*lead, rows, blocks * BLOCK // 2, dtype=torch.uint8, device=device),
                "scale": torch.empty(*lead, rows, blocks, dtype=torch.uint8, device=device)}
