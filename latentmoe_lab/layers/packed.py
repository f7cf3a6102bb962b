"""Packed (varlen) sequences: what the token-mixing layers need to know about sequence boundaries.

Several sequences can share one row of a batch, back to back (the `cu_seqlens` layout of
flash-attention's varlen interface: sequence s is tokens cu_seqlens[s] : cu_seqlens[s+1]). Norms, FFNs
and the MoE treat tokens one by one and need nothing. The layers that mix tokens take

    sequence_start [B, T] int64     position of the first token of each token's own sequence

Gated DSA lets no query see a key before its sequence_start; KDA erases its state at every token whose
position equals its sequence_start and keeps its short conv inside the sequence.
"""
from __future__ import annotations

import torch


def sequence_start_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens [S + 1] (0, l_0, l_0 + l_1, ..., total) -> sequence_start [1, total]."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise TypeError("cu_seqlens: expected an int64 tensor [S + 1] of cumulative sequence lengths")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected shape [S + 1] with S >= 1, got {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((cu_seqlens.diff() <= 0).any()):
        raise ValueError(f"cu_seqlens: must start at 0, increase strictly and end at the packed length {total}, "
                         f"got {cu_seqlens.tolist()}")
    lengths = cu_seqlens.diff().long()
    return torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)[None, :]


def check_sequence_start(sequence_start: torch.Tensor | None, x: torch.Tensor, cache) -> None:
    """sequence_start [B, T] int for x [B, T, hidden]: each entry in [0, its own position], and no cache."""
    if sequence_start is None:
        return
    if cache is not None:
        raise ValueError("sequence_start: packed sequences cannot continue a cache; pass cache=None")
    if not isinstance(sequence_start, torch.Tensor) or sequence_start.dtype not in (torch.int64, torch.int32):
        raise TypeError("sequence_start: expected an int64 tensor [B, T]")
    if sequence_start.shape != x.shape[:2]:
        raise ValueError(f"sequence_start: expected shape [B, T] = {tuple(x.shape[:2])}, "
                         f"got {tuple(sequence_start.shape)}")
    positions = torch.arange(x.shape[1], device=sequence_start.device)
    if bool((sequence_start < 0).any()) or bool((sequence_start > positions).any()):
        raise ValueError("sequence_start: every entry must lie in [0, its own position]")
