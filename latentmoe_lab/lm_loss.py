"""The language-model loss: next-token cross-entropy in fp32 over labels aligned with input_ids, and the check
of those labels (what LatentMoEForCausalLM.forward(labels=) and the native trainers compute)."""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


def check_labels(labels: torch.Tensor | None, input_ids: torch.Tensor, vocab_size: int) -> None:
    """labels [B, T] (or None): int ids in [0, vocab_size) or IGNORE_INDEX, shaped like input_ids."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError("labels: expected an int64 tensor [B, T] aligned with input_ids")
    if isinstance(input_ids, torch.Tensor) and labels.shape != input_ids.shape:
        raise ValueError(f"labels: expected the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    kept = labels[labels != IGNORE_INDEX]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size):
        raise ValueError(f"labels: must be token ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored)")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   sequence_start: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32: logits [B, T, V] at t against labels [B, T] at t + 1.

    Targets equal to -100, and targets that open a packed sequence (sequence_start[b, t] == t), are ignored;
    with no target left the loss is 0 (with a graph), not NaN.
    """
    targets = labels[:, 1:].long()
    if sequence_start is not None:
        positions = torch.arange(1, labels.shape[1], device=labels.device)
        targets = targets.masked_fill(sequence_start[:, 1:].to(labels.device) == positions, IGNORE_INDEX)
    flat_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    kept = flat_targets != IGNORE_INDEX
    summed = torch.nn.functional.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / kept.sum().clamp(min=1)
