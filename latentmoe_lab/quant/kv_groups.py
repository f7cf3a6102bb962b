"""Per-token group scaling shared by the quantized KV formats (docs/design.md §7).

A token's D values split into G = ceil(D / 128) groups of 128 channels; the last group takes the remainder when
D is not a multiple of 128 (the tiny preset's 16-wide latent is one group of 16). Each group has one fp32
scale = absmax(group) / qmax, and values are stored as
    fp8   e4m3 bit patterns of value / scale   (qmax 448; per element relative error <= 2^-4 above 2^-6 * scale)
    int8  round(value / scale) in [-127, 127]  (qmax 127; per element error <= scale / 2)
An all-zero group gets scale 0 and codes 0, and decodes to exact zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 128
QMAX = {"fp8": 448.0, "int8": 127.0}


def num_groups(dim: int) -> int:
    return -(-dim // GROUP)


def check_dtype(dtype: str) -> None:
    if dtype not in QMAX:
        raise ValueError(f"dtype: quantized KV values are one of {sorted(QMAX)}, got {dtype!r}")


def encode_groups(values: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """values [N, D] -> (codes uint8 [N, D], scales fp32 [N, G])."""
    x = values.float()
    dim = x.shape[-1]
    groups = F.pad(x, (0, (-dim) % GROUP)).unflatten(-1, (-1, GROUP))  # [N, G, 128], zero padding
    scales = groups.abs().amax(dim=-1) / QMAX[dtype]
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = (groups / divisor[..., None]).flatten(-2)[..., :dim].clamp(-QMAX[dtype], QMAX[dtype])
    if dtype == "fp8":
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = scaled.round().to(torch.int8).view(torch.uint8)
    return codes, scales


def decode_groups(codes: torch.Tensor, scales: torch.Tensor, dtype: str) -> torch.Tensor:
    """(codes uint8 [M, D], scales fp32 [M, G]) -> values fp32 [M, D]."""
    dim = codes.shape[-1]
    values = codes.view(torch.float8_e4m3fn if dtype == "fp8" else torch.int8).float()
    return values * scales.repeat_interleave(GROUP, dim=-1)[..., :dim]


def check_positions(name: str, positions: torch.Tensor, capacity: int) -> None:
    """Flat pool positions must be a 1-D integer tensor inside [0, capacity)."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name}: expected a 1-D tensor of flat pool positions, got {shape}")
    if positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer dtype, got {positions.dtype}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= capacity):
        raise ValueError(f"{name}: positions must lie in [0, num_blocks * block_size = {capacity}), got range "
                         f"[{int(positions.min())}, {int(positions.max())}]")


def check_storage(storage: torch.Tensor, bytes_per_token: int) -> int:
    """storage uint8 [num_blocks, block_bytes] with block_bytes a multiple of bytes_per_token -> block_size."""
    if not isinstance(storage, torch.Tensor) or storage.dtype != torch.uint8 or storage.dim() != 2:
        desc = (f"{storage.dtype} {tuple(storage.shape)}" if isinstance(storage, torch.Tensor)
                else type(storage).__name__)
        raise ValueError(f"storage: expected uint8 [num_blocks, block_bytes] from allocate(), got {desc}")
    if storage.shape[1] % bytes_per_token:
        raise ValueError(f"storage: block_bytes {storage.shape[1]} is not a multiple of this format's "
                         f"{bytes_per_token} bytes per token")
    return storage.shape[1] // bytes_per_token


def check_values(values: torch.Tensor, slot_mapping: torch.Tensor, dim: int) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[1] != dim:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"values: expected shape [N, dim={dim}], got {shape}")
    if values.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} positions for {values.shape[0]} value rows")
