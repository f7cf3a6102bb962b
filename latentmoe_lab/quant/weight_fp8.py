"""FP8 e4m3 weights with one fp32 scale per 128 x 128 block (docs/design.md §7, the DeepSeek-V3 format).

Byte layout of one weight W [..., O, I] (out, in: nn.Linear order; stacked experts are packed [E, O, I]):

    data   uint8 [..., O, I]                       e4m3 bit patterns of W / scale, row-major
    scale  fp32  [..., ceil(O/128), ceil(I/128)]   scale[bo, bi] = absmax(W[block bo, bi]) / 448

Bytes: O * I + 4 * ceil(O/128) * ceil(I/128) per matrix. A ragged last block row or column (a dim that is not a
multiple of 128) is a smaller block with its own absmax; nothing is padded. The values sit in uint8, not in
torch.float8_e4m3fn, so that `model.to(dtype)` (which casts every floating tensor) cannot touch them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3_MAX = 448.0  # largest finite e4m3fn value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Fp8BlockFormat:
    name = "fp8"
    row_tile = BLOCK  # row tiles must start on a block boundary so each takes whole scale rows

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight [..., O, I] float -> {"data": uint8 [..., O, I], "scale": fp32 [..., ceil(O/128), ceil(I/128)]}."""
        w = weight.detach().float()
        rows, cols = w.shape[-2:]
        padded = F.pad(w, (0, (-cols) % BLOCK, 0, (-rows) % BLOCK))  # zeros never raise a block's absmax
        blocks = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [..., bo, 128, bi, 128]
        scale = blocks.abs().amax(dim=(-3, -1)) / E4M3_MAX
        scaled = w / self._expand(torch.where(scale > 0, scale, torch.ones_like(scale)), rows, cols)
        data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return {"data": data, "scale": scale}

    def unpack(self, packed: dict[str, torch.Tensor], start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the weight, fp32 [..., stop - start, I]; start must be a multiple of 128."""
        data, scale = packed["data"], packed["scale"]
        stop = data.shape[-2] if stop is None else stop
        if start % BLOCK:
            raise ValueError(f"start: fp8 row tiles begin on a {BLOCK}-row block boundary, got {start}")
        values = data[..., start:stop, :].view(torch.float8_e4m3fn).float()
        block_scale = scale[..., start // BLOCK:_ceil_div(stop, BLOCK), :]
        return values * self._expand(block_scale, stop - start, data.shape[-1])

    def empty(self, shape: tuple[int, ...], device=None) -> dict[str, torch.Tensor]:
        """Uninitialised storage for a weight of `shape` [..., O, I] (filled by a checkpoint load)."""
        *lead, rows, cols = shape
        return {"data": torch.empty(shape, dtype=torch.uint8, device=device),
                "scale": torch.empty(*lead, _ceil_div(rows, BLOCK), _ceil_div(cols, BLOCK), device=device)}

    @staticmethod
    def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[..., bo, bi] block scales -> [..., rows, cols], one per element."""
        return scale.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]
