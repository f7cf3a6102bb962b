"""What quantization costs and saves: bytes held per component, held-out bits per byte, top-1 agreement.

Bytes are counted from the tensors a model holds (parameters + buffers), by meta.py component; the routing
biases count under "router". Bits per byte: the byte tokenizer gives one token per byte, so the mean
next-token cross-entropy in nats / ln 2 is bits per byte (8.0 is a uniform guess).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from latentmoe_lab.meta import format_bytes
from latentmoe_lab.param_components import COMPONENTS, component_of


def held_bytes_by_component(model: nn.Module) -> dict[str, int]:
    """{component: bytes} of every parameter and buffer, plus "total"."""
    by_component = dict.fromkeys(COMPONENTS, 0)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in tensors:
        component = "router" if name.endswith("correction_bias") else component_of(name, model)
        by_component[component] += tensor.numel() * tensor.element_size()
    return {**by_component, "total": sum(by_component.values())}


def byte_table(before: dict[str, int], after: dict[str, int]) -> str:
    lines = [f"{'component':<20}{'before':>12}{'after':>12}{'ratio':>8}"]
    for name in (*COMPONENTS, "total"):
        if before[name] or after[name]:
            ratio = after[name] / before[name] if before[name] else float("nan")
            lines.append(f"{name:<20}{format_bytes(before[name]):>12}{format_bytes(after[name]):>12}{ratio:>8.3f}")
    return "\n".join(lines)


@torch.no_grad()
def bits_per_byte(model: nn.Module, rows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-byte cross-entropy over rows [R, T] of byte tokens, in bits."""
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] < 2:
        raise ValueError(f"rows: expected [R >= 1, T >= 2] byte tokens, got shape {tuple(rows.shape)}")
    total, targets = 0.0, 0
    for start in range(0, rows.shape[0], batch):
        ids = rows[start:start + batch].long()
        total += float(model(ids, labels=ids).loss) * ids[:, 1:].numel()
        targets += ids[:, 1:].numel()
    return total / targets / math.log(2)


@torch.no_grad()
def top1_agreement(reference: nn.Module, candidate: nn.Module, rows: torch.Tensor, batch: int = 8) -> float:
    """Share of positions where both models' most likely next token is the same."""
    agree, count = 0, 0
    for start in range(0, rows.shape[0], batch):
        ids = rows[start:start + batch].long()
        agree += int((reference(ids).logits.argmax(-1) == candidate(ids).logits.argmax(-1)).sum())
        count += ids.numel()
    return agree / count
