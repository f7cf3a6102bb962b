"""Non-finite logits, caught and located (docs/design.md §4: never silently produce NaN).

The forward records, as device tensors, whether the hidden state was finite after the embeddings,
after each block and after the final norm (`CausalLMOutput.finite`, [num_layers + 2] bool). That is
one reduction per block and no host sync. Only a caller that decides on the logits (generate, the
serving engine) looks, with one sync per step, and reads the flags only when the logits are not finite:

    output = model(ids, cache=cache)
    check_finite_logits(output.logits, output.finite, model.config.layer_types)

A NaN born in the LM head leaves every flag true and is blamed on "lm_head"; one born in layer 2
turns flags 3.. false and is blamed on layer 2.
"""
from __future__ import annotations

import torch


class NonFiniteError(FloatingPointError):
    """The logits hold NaN or inf; the message names where they first appeared."""


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on x's device: every element finite (no host sync)."""
    return torch.isfinite(x).all()


def first_non_finite(finite: torch.Tensor | None, layer_types: list[str] | None = None) -> str:
    """Where the forward first went non-finite, from flags [num_layers + 2] (embeddings, blocks, final norm)."""
    if finite is None:
        return "unknown (no per-layer flags were recorded)"
    bad = (~finite.bool()).nonzero().flatten().tolist()
    if not bad:
        return "lm_head (every hidden state up to the final norm was finite)"
    first, num_layers = bad[0], finite.numel() - 2
    if first == 0:
        return "the embeddings"
    if first > num_layers:
        return "the final norm"
    kind = f" ({layer_types[first - 1]})" if layer_types is not None else ""
    return f"layer {first - 1}{kind}"


def check_finite_logits(logits: torch.Tensor, finite: torch.Tensor | None = None,
                        layer_types: list[str] | None = None, where: str = "forward") -> None:
    """Raise NonFiniteError if logits [..., vocab] hold NaN or inf, naming the first layer that went
    non-finite (from `finite`, see CausalLMOutput). `where` says which call, e.g. "generate step 3"."""
    if bool(all_finite(logits)):
        return
    nan = int(torch.isnan(logits).sum())
    inf = int(torch.isinf(logits).sum())
    raise NonFiniteError(f"logits: {nan} NaN and {inf} inf values in {where}; first non-finite at "
                         f"{first_non_finite(finite, layer_types)}")
