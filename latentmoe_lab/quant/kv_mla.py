"""Quantized MLA cache entry (docs/design.md §7): the latent c_kv in fp8 e4m3 (or int8), the rope key in bf16.

Byte layout, token-interleaved: token o of block b is row b, bytes [o * E, (o + 1) * E), and inside it

    offset 0          kv_lora bytes          latent codes (e4m3 bit patterns, or int8), channel order
    offset kv_lora    4 * G bytes            fp32 scales, one per group of 128 latent channels, G = ceil(kv_lora/128)
    offset +4G        2 * rope bytes         the rope key in bf16, unquantized

E = kv_lora + 4 * G + 2 * rope: 512 + 16 + 128 = 656 bytes at k3-2.8t (kv_lora 512, rope 64), against 1152 in
bf16. A latent width that is not a multiple of 128 ends in one smaller group (quant/kv_groups.py): the tiny
preset's 16 + 8 entry is 16 + 4 + 16 = 36 bytes.
Values in: [N, kv_lora + rope] (latent first, as the layers concatenate them); out: the same, fp32.
"""
from __future__ import annotations

import torch

from latentmoe_lab.quant.kv_groups import (check_dtype, check_positions, check_storage, check_values, decode_groups,
                                           encode_groups, num_groups)


class QuantizedLatentFormat:
    def __init__(self, kv_lora_rank: int, rope_dim: int, dtype: str = "fp8"):
        check_dtype(dtype)
        for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "kv_lora_rank" else 0):
                raise ValueError(f"{name}: must be a positive integer (rope_dim may be 0), got {value!r}")
        self.kv_lora_rank, self.rope_dim, self.dtype = kv_lora_rank, rope_dim, dtype
        self.dim = kv_lora_rank + rope_dim
        self.scale_offset = kv_lora_rank
        self.rope_offset = kv_lora_rank + 4 * num_groups(kv_lora_rank)

    def bytes_per_token(self, dim: int) -> int:
        if dim != self.dim:
            raise ValueError(f"dim: this format holds kv_lora {self.kv_lora_rank} + rope {self.rope_dim} = "
                             f"{self.dim} values per token, got {dim}")
        return self.rope_offset + 2 * self.rope_dim

    def allocate(self, num_blocks: int, block_size: int, dim: int, device=None) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size * self.bytes_per_token(dim), dtype=torch.uint8, device=device)

    def write(self, storage: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """Encode values [N, kv_lora + rope] into the entries at flat positions slot_mapping [N]."""
        rows = self._rows(storage)
        check_positions("slot_mapping", slot_mapping, rows.shape[0])
        check_values(values, slot_mapping, self.dim)
        latent, rope = values.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        codes, scales = encode_groups(latent, self.dtype)
        entry = torch.cat([codes, scales.view(torch.uint8), rope.to(torch.bfloat16).contiguous().view(torch.uint8)],
                          dim=-1)
        rows[slot_mapping] = entry

    def read(self, storage: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decode the entries at flat positions [M] -> [M, kv_lora + rope] fp32."""
        rows = self._rows(storage)
        check_positions("positions", positions, rows.shape[0])
        entry = rows[positions]  # [M, E], a copy: the byte slices below are contiguous-able
        scales = entry[:, self.scale_offset:self.rope_offset].contiguous().view(torch.float32)
        latent = decode_groups(entry[:, :self.kv_lora_rank], scales, self.dtype)
        rope = entry[:, self.rope_offset:].contiguous().view(torch.bfloat16).float()
        return torch.cat([latent, rope], dim=-1)

    def _rows(self, storage: torch.Tensor) -> torch.Tensor:
        bpt = self.bytes_per_token(self.dim)
        check_storage(storage, bpt)
        return storage.view(-1, bpt)
