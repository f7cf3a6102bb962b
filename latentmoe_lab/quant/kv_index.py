"""Quantized lightning-indexer key cache (docs/design.md §7): fp8 e4m3 (or int8) values + fp32 scales, block-planar.

Byte layout of block b (row b of the [num_blocks, block_bytes] storage), with bs = block_size, D = d_I,
G = ceil(D / 128) scale groups per token:

    offset 0              bs * D bytes        values: token o's D codes at [o * D, (o + 1) * D)
    offset bs * D         bs * 4 * G bytes    scales: token o's G fp32 scales at bs * D + [4 G o, 4 G (o + 1))

So a block is all its values, then all its scales (block-planar), not value-scale pairs per token: a kernel
loads the block's bs x D value tile in one piece. Per token 128 + 4 = 132 bytes at k3-2.8t (d_I 128), against
256 in bf16. A reader that assumed token-interleaved order would see scale bytes as values: silently wrong top-k.
"""
from __future__ import annotations

import torch

from latentmoe_lab.quant.kv_groups import (check_dtype, check_positions, check_storage, check_values, decode_groups,
                                           encode_groups, num_groups)


class QuantizedIndexFormat:
    def __init__(self, dim: int, dtype: str = "fp8"):
        check_dtype(dtype)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim: must be a positive integer, got {dim!r}")
        self.dim, self.dtype, self.groups = dim, dtype, num_groups(dim)

    def bytes_per_token(self, dim: int) -> int:
        if dim != self.dim:
            raise ValueError(f"dim: this format holds {self.dim} values per token, got {dim}")
        return dim + 4 * self.groups

    def allocate(self, num_blocks: int, block_size: int, dim: int, device=None) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size * self.bytes_per_token(dim), dtype=torch.uint8, device=device)

    def write(self, storage: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """Encode keys [N, D] at flat positions slot_mapping [N]."""
        value_at, scale_at = self._byte_index(storage, slot_mapping, "slot_mapping")
        check_values(values, slot_mapping, self.dim)
        codes, scales = encode_groups(values, self.dtype)
        flat = storage.view(-1)
        flat[value_at] = codes
        flat[scale_at] = scales.view(torch.uint8)

    def read(self, storage: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decode the keys at flat positions [M] -> [M, D] fp32."""
        value_at, scale_at = self._byte_index(storage, positions, "positions")
        flat = storage.view(-1)
        return decode_groups(flat[value_at], flat[scale_at].view(torch.float32), self.dtype)

    def _byte_index(self, storage: torch.Tensor, positions: torch.Tensor, name: str):
        """Byte offsets into storage.view(-1) of each position's values [N, D] and scales [N, 4G]."""
        block_size = check_storage(storage, self.bytes_per_token(self.dim))
        check_positions(name, positions, storage.shape[0] * block_size)
        block, offset = positions.long().div(block_size, rounding_mode="floor"), positions.long() % block_size
        base = (block * storage.shape[1])[:, None]
        channels = torch.arange(self.dim, device=positions.device)
        scale_bytes = torch.arange(4 * self.groups, device=positions.device)
        value_at = base + offset[:, None] * self.dim + channels
        scale_at = base + block_size * self.dim + offset[:, None] * 4 * self.groups + scale_bytes
        return value_at, scale_at
