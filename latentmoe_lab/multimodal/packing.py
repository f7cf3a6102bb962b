"""Padded and packed (varlen) layouts of a mixed batch.

    padded  input_ids [B, T_max], right-padded; attention_mask marks the real tokens.
            Simple, but a batch of one long and many short samples wastes most of its compute on <pad>.
    packed  input_ids [1, sum(lengths)], the samples back to back; cu_seqlens [B + 1] holds the
            cumulative lengths (0, l_0, l_0 + l_1, ...), as in flash-attention's varlen interface.
            No padding at all; the model must stop attention and the KDA state at every boundary.

Image order is the same in both layouts (sample after sample), so pixel_values and image_grids are shared.
"""
from __future__ import annotations

import torch

from latentmoe_lab.multimodal.processor import MultimodalBatch


def pack(batch: MultimodalBatch) -> MultimodalBatch:
    """A padded batch -> the packed layout (input_ids [1, total], cu_seqlens [B + 1])."""
    if batch.cu_seqlens is not None:
        raise ValueError("batch: already packed (cu_seqlens is set)")
    mask = batch.attention_mask
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("batch.attention_mask: every sample needs at least one real token to be packed")
    expected = torch.arange(mask.shape[1])[None, :] < lengths[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("batch.attention_mask: expected right padding (real tokens first in every row)")
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    input_ids = batch.input_ids[mask][None, :]
    return MultimodalBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids, dtype=torch.bool),
                           pixel_values=batch.pixel_values, image_grids=batch.image_grids,
                           images_per_sample=list(batch.images_per_sample), cu_seqlens=cu_seqlens)


def unpack(values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """values [1, total, ...] of a packed batch -> one tensor [length_s, ...] per sample."""
    if values.dim() < 2 or values.shape[0] != 1 or values.shape[1] != int(cu_seqlens[-1]):
        raise ValueError(f"values: expected shape [1, total={int(cu_seqlens[-1])}, ...], got {tuple(values.shape)}")
    return list(values[0].split(cu_seqlens.diff().tolist()))


def unpad(values: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """values [B, T, ...] of a padded batch -> one tensor [length_b, ...] per row (padding dropped)."""
    if values.shape[:2] != attention_mask.shape:
        raise ValueError(f"values: leading dims must be attention_mask's {tuple(attention_mask.shape)}, "
                         f"got {tuple(values.shape)}")
    return [row[keep] for row, keep in zip(values, attention_mask)]


def padding_fraction(batch: MultimodalBatch) -> float:
    """Share of the padded layout's positions that are <pad> (what packing saves)."""
    mask = batch.attention_mask
    return 1.0 - float(mask.sum()) / mask.numel()
