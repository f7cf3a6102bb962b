"""4-bit lightning-indexer key cache (docs/design.md §7, §15.1): INT4 or FP4 (e2m1) codes, two per byte, with one
fp16 scale per group of 32 channels. Selected by `memory.index_key_dtype: int4 | fp4`.

The indexer only ranks keys (top-k of sum_j w_j ReLU(q_j . k_s)), so a coarse key costs selections that swap
near-equal candidates, not values the attention reads; the MLA latent keeps its own format. With memory.offload
(docs/design.md §15.1) every token's index key stays on the device, so its width sets the device bytes at long
context.

Byte layout, token-interleaved: token o of block b is row b, bytes [o * E, (o + 1) * E), and inside it

    offset 0            ceil(D / 2) bytes    codes: channel 2i in the low nibble of byte i, 2i + 1 in the high one
    offset ceil(D/2)    2 * G bytes          fp16 scales, one per group of 32 channels, G = ceil(D / 32)
                                             (the last group takes the remainder)

E = 64 + 8 = 72 bytes at k3-2.8t (d_I 128), against 132 in fp8 and 256 in bf16; 36 in the small preset (d_I 64).
A token's bytes are one contiguous row, so a read gathers E bytes per position and unpacks them.

Codes, per group with absmax a:
    int4  scale s = a / 7; code round(v / s) in [-7, 7], a two's-complement nibble (-8 unused: symmetric)
    fp4   scale s = a / 6; code the nearest e2m1 value of v / s: sign bit 3, magnitude index bits 0-2 into
          {0, 0.5, 1, 1.5, 2, 3, 4, 6} (a value halfway between two goes to the smaller magnitude)
The scale is rounded to fp16 before the codes are computed (so decoding uses the scale the codes were made
with), clamped to fp16's largest finite value; a value past qmax x scale saturates. An all-zero group gets
scale 0 and decodes to exact zeros. Values in: [N, D]; out: [N, D] fp32.

`fake_quantize_keys` is the plain reference twin: the same values, computed per group with no packing or byte
layout; tests/test_index_keys.py compares the two on ragged shapes. `selection_recall` is what a coarser key
costs: the share of the full-precision top-k that the selection over decoded keys still picks (given the
full-precision scores, keys tied at the k-th score count as interchangeable).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentmoe_lab.quant.kv_groups import check_positions, check_storage, check_values

GROUP = 32
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1: 1 sign, 2 exponent, 1 mantissa bit
QMAX = {"int4": 7.0, "fp4": 6.0}
FP16_MAX = torch.finfo(torch.float16).max


def _decode_table(dtype: str) -> torch.Tensor:
    """The value of each of the 16 nibbles, fp32 [16]."""
    nibbles = torch.arange(16)
    if dtype == "int4":
        return torch.where(nibbles < 8, nibbles, nibbles - 16).float()
    magnitudes = torch.tensor(FP4_MAGNITUDES)[nibbles % 8]
    return torch.where(nibbles < 8, magnitudes, -magnitudes)


class FourBitIndexFormat:
    """Index keys of `dim` channels in int4 or fp4 codes with fp16 group scales (the pools' format protocol)."""

    def __init__(self, dim: int, dtype: str = "int4", group: int = GROUP):
        if dtype not in QMAX:
            raise ValueError(f"dtype: 4-bit index keys are one of {sorted(QMAX)}, got {dtype!r}")
        for name, value in (("dim", dim), ("group", group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if group % 2:
            raise ValueError(f"group: must be even (a byte holds two channels of one group), got {group}")
        self.dim, self.dtype, self.group = dim, dtype, group
        self.groups = -(-dim // group)
        self.code_bytes = -(-dim // 2)
        self.table = _decode_table(dtype)

    def __repr__(self) -> str:
        return f"FourBitIndexFormat(dim={self.dim}, dtype={self.dtype!r}, group={self.group})"

    def bytes_per_token(self, dim: int) -> int:
        if dim != self.dim:
            raise ValueError(f"dim: this format holds {self.dim} values per token, got {dim}")
        return self.code_bytes + 2 * self.groups

    def allocate(self, num_blocks: int, block_size: int, dim: int, device=None) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size * self.bytes_per_token(dim), dtype=torch.uint8, device=device)

    def write(self, storage: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """Encode keys [N, D] at flat positions slot_mapping [N]."""
        rows = self._rows(storage, slot_mapping, "slot_mapping")
        check_values(values, slot_mapping, self.dim)
        nibbles, scales = self.encode(values)
        if self.dim % 2:  # a zero high nibble completes the last byte
            nibbles = F.pad(nibbles, (0, 1))
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        rows[slot_mapping] = torch.cat([packed, scales.view(torch.uint8)], dim=-1)

    def read(self, storage: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decode the keys at flat positions [M] -> [M, D] fp32."""
        entry = self._rows(storage, positions, "positions")[positions]  # [M, E], a copy
        packed = entry[:, :self.code_bytes]
        nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)[:, :self.dim]
        scales = entry[:, self.code_bytes:].contiguous().view(torch.float16).float()  # [M, G]
        table = self.table.to(storage.device)
        return table[nibbles.long()] * scales.repeat_interleave(self.group, dim=-1)[:, :self.dim]

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """values [N, D] -> (nibbles uint8 [N, D] in 0..15, scales fp16 [N, G])."""
        groups = F.pad(values.float(), (0, self.groups * self.group - self.dim)).unflatten(-1, (-1, self.group))
        scales = (groups.abs().amax(dim=-1) / QMAX[self.dtype]).clamp(max=FP16_MAX).to(torch.float16)
        divisor = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
        scaled = (groups / divisor[..., None]).flatten(-2)[:, :self.dim]
        if self.dtype == "int4":
            codes = scaled.round().clamp(-7, 7).to(torch.int8)
            return (codes & 15).to(torch.uint8), scales
        midpoints = torch.tensor(FP4_MAGNITUDES, device=values.device)
        midpoints = (midpoints[1:] + midpoints[:-1]) / 2  # a magnitude's index: how many midpoints lie below it
        magnitude = torch.bucketize(scaled.abs(), midpoints)  # ties (exactly a midpoint) go to the smaller one
        return (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).to(torch.uint8), scales

    def _rows(self, storage: torch.Tensor, positions: torch.Tensor, name: str) -> torch.Tensor:
        per_token = self.bytes_per_token(self.dim)
        check_storage(storage, per_token)
        rows = storage.view(-1, per_token)
        check_positions(name, positions, rows.shape[0])
        return rows


def fake_quantize_keys(values: torch.Tensor, dtype: str = "int4", group: int = GROUP) -> torch.Tensor:
    """The reference twin of FourBitIndexFormat's write + read: values [N, D] -> [N, D] fp32, group by group.

    No packing, no byte layout, no lookup table: int4 rounds and clamps, fp4 takes the nearest e2m1 magnitude
    (the smaller on a tie), both against the group's fp16 scale."""
    if dtype not in QMAX:
        raise ValueError(f"dtype: 4-bit index keys are one of {sorted(QMAX)}, got {dtype!r}")
    out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    grid = torch.tensor(FP4_MAGNITUDES, device=values.device)
    for start in range(0, values.shape[-1], group):
        chunk = values[:, start:start + group].float()
        scale = (chunk.abs().amax(dim=-1, keepdim=True) / QMAX[dtype]).clamp(max=FP16_MAX).half().float()
        scaled = chunk / torch.where(scale > 0, scale, torch.ones_like(scale))
        if dtype == "int4":
            levels = scaled.round().clamp(-7, 7)
        else:  # nearest magnitude, the first (smaller) of equally near ones
            levels = grid[(scaled.abs()[..., None] - grid).abs().argmin(dim=-1)] * scaled.sign()
        out[:, start:start + group] = levels * scale
    return out


def selection_hits(selected: torch.Tensor, reference: torch.Tensor, scores: torch.Tensor | None = None
                   ) -> tuple[int, int]:
    """(hits, reference positions) of a top-k selection against the full-precision one; selection_recall's parts.

    selected, reference [..., k] int64 positions (distinct within a row, -1 pads), as index_topk returns them.
    Without scores a hit is a position both pick. With the full-precision scores [..., S] of the same queries, a
    hit is a picked position whose score reaches the reference's k-th best: keys tied at that threshold are
    interchangeable (ReLU heads give many exact zeros when few keys score above 0, and which of them fill the
    top-k is then only the position tie rule)."""
    if selected.shape != reference.shape:
        raise ValueError(f"selected: expected the reference's shape {tuple(reference.shape)}, got "
                         f"{tuple(selected.shape)}")
    picked = int((reference >= 0).sum())
    if scores is not None:
        worst = scores.gather(-1, reference.clamp(min=0)).masked_fill(reference < 0, float("inf")).amin(-1)
        reached = scores.gather(-1, selected.clamp(min=0)) >= worst[..., None]
        return int((reached & (selected >= 0)).sum()), picked
    ordered = reference.sort(dim=-1).values
    at = torch.searchsorted(ordered, selected).clamp(max=ordered.shape[-1] - 1)
    return int(((ordered.gather(-1, at) == selected) & (selected >= 0)).sum()), picked


def selection_recall(selected: torch.Tensor, reference: torch.Tensor, scores: torch.Tensor | None = None) -> float:
    """hits / reference positions over all queries (selection_hits); 1.0 when the reference picks nothing."""
    hits, picked = selection_hits(selected, reference, scores)
    return hits / picked if picked else 1.0
