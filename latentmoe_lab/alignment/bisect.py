"""Which layer's change causes the final error: swap single units between reference and candidate.

Units: embed_tokens, layers.0 .. layers.{L-1}, norm, lm_head. For each unit u:

    alone[u]     error of the reference with only u taken from the candidate
    repaired[u]  error of the candidate with only u put back from the reference

where error is KL(ref || hybrid) of the final logits, mean over tokens (nats). The culprit is the unit
with the largest `alone` error. `repaired` says how much of the total error goes away by fixing u
alone; with one broken unit both point at it, with many small ones (a dtype change) `alone` ranks the
layers by how much error each one adds on its own. Bisection needs the candidate as a module with
the reference's structure (dtype casts, edited weights, quantized layers), not a process layout.

Swapped units run in their own dtype: a cast wrapper converts the hidden state at the unit's input
and output, so a bf16 block drops into an fp32 model and back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from latentmoe_lab.alignment.metrics import kl_per_token
from latentmoe_lab.alignment.taps import model_parts


class _CastTo(nn.Module):
    """Run `unit` in its own dtype inside a model of another: floating inputs in, outputs back."""

    def __init__(self, unit: nn.Module, outer_dtype: torch.dtype):
        super().__init__()
        self.unit, self.outer_dtype = unit, outer_dtype
        self.inner_dtype = next(unit.parameters()).dtype

    def forward(self, x, *args, **kwargs):
        if x.is_floating_point():
            x = x.to(self.inner_dtype)
        out = self.unit(x, *args, **kwargs)
        return out.to(self.outer_dtype) if out.is_floating_point() else out


def _units(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Unit name -> (parent module, attribute or index) for every swappable unit."""
    config, _, _, _ = model_parts(model)
    if not hasattr(model, "layers"):
        raise TypeError(f"model: bisection swaps the units of a LatentMoEForCausalLM, got {type(model).__name__}")
    units = {"embed_tokens": (model, "embed_tokens")}
    units.update({f"layers.{i}": (model.layers, str(i)) for i in range(config.num_layers)})
    units.update({"norm": (model, "norm"), "lm_head": (model, "lm_head")})
    return units


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


@contextlib.contextmanager
def _swapped(target: nn.Module, donor: nn.Module, unit: str) -> Iterator[None]:
    """Inside the block, `target`'s unit is `donor`'s (cast to fit when the dtypes differ)."""
    parent, attr = _units(target)[unit]
    donor_parent, _ = _units(donor)[unit]
    original, incoming = parent._modules[attr], donor_parent._modules[attr]
    if _dtype(donor) != _dtype(target):
        incoming = _CastTo(incoming, _dtype(target))
    parent._modules[attr] = incoming
    try:
        yield
    finally:
        parent._modules[attr] = original


@dataclass
class BisectResult:
    """total: the candidate's error; alone / repaired: per unit, in model order (see the module doc)."""

    total: float
    alone: dict[str, float]
    repaired: dict[str, float]

    @property
    def culprit(self) -> str:
        """The unit whose change alone makes the largest error."""
        return max(self.alone, key=self.alone.get)

    def share_fixed(self, unit: str) -> float:
        """Share of the total error that putting back `unit` alone removes (1 = all of it)."""
        return 0.0 if self.total == 0 else (self.total - self.repaired[unit]) / self.total

    def table(self) -> str:
        lines = [f"total KL(ref || cand) {self.total:.3e} nats; culprit: {self.culprit}",
                 f"{'unit':<16}{'alone':>12}{'repaired':>12}{'fixed':>8}"]
        for unit in self.alone:
            lines.append(f"{unit:<16}{self.alone[unit]:>12.3e}{self.repaired[unit]:>12.3e}"
                         f"{self.share_fixed(unit):>8.1%}")
        return "\n".join(lines)


@torch.no_grad()
def bisect_layers(reference: nn.Module, candidate: nn.Module, inputs) -> BisectResult:
    """Swap every unit both ways and measure the final-logits KL; inputs: input_ids [B, T] or forward kwargs."""
    if not isinstance(candidate, nn.Module):
        raise TypeError(f"candidate: bisection needs a module with the reference's structure, "
                        f"got {type(candidate).__name__}")
    units = _units(reference)
    if list(_units(candidate)) != list(units):
        raise ValueError("candidate: has other units than the reference (a different config)")

    def logits(model: nn.Module) -> torch.Tensor:
        return (model(**inputs) if isinstance(inputs, Mapping) else model(inputs)).logits

    ref_logits = logits(reference)

    def error(model: nn.Module) -> float:
        return float(kl_per_token(ref_logits, logits(model)).mean())

    total = error(candidate)
    alone, repaired = {}, {}
    for unit in units:
        with _swapped(reference, candidate, unit):
            alone[unit] = error(reference)
        with _swapped(candidate, reference, unit):
            repaired[unit] = error(candidate)
    return BisectResult(total, alone, repaired)
