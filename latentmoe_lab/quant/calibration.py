"""Calibration of static activation scales (docs/design.md §7), and the channel statistics SmoothQuant needs.

`calibrate(model, batches, method)` runs a quantized model over calibration batches (a held-out slice of the
training corpus, in the CLI) with every static ActivationQuantizer observing its input, then sets each one's
per-tensor scale = clip / qmax, where the clip of the observed values x is
    absmax       max |x|                                        (every value representable, coarse grid)
    percentile   the p-th percentile of |x| (p = 99.99 by default): a few outliers saturate
    mse          argmin over c in {absmax * k / 64, k = 1..64} of mean (fake_quant(x, c / qmax) - x)^2
Percentile and mse work on a uniform random sample of the observed values (a fixed generator: reproducible).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from latentmoe_lab.quant.activations import QMAX, ActivationQuantizer, fake_quantize
from latentmoe_lab.quant.recipes import CALIBRATION_METHODS

SAMPLES_PER_CALL = 4096
MAX_SAMPLES = 1 << 18
MSE_GRID = 64


class ActivationStats:
    """Running absmax of everything observed, plus a bounded random sample of the values."""

    def __init__(self, seed: int = 0):
        self.absmax = 0.0
        self.samples: list[torch.Tensor] = []
        self.generator = torch.Generator().manual_seed(seed)

    def observe(self, x: torch.Tensor) -> None:
        flat = x.detach().float().flatten().cpu()
        if flat.numel() == 0:
            return
        self.absmax = max(self.absmax, float(flat.abs().max()))
        if sum(s.numel() for s in self.samples) < MAX_SAMPLES:
            pick = torch.randint(flat.numel(), (min(SAMPLES_PER_CALL, flat.numel()),), generator=self.generator)
            self.samples.append(flat[pick])

    def clip(self, method: str, dtype: str, percentile: float = 99.99) -> float:
        """The clip value of the observed distribution under `method` (see the module docstring)."""
        if method not in CALIBRATION_METHODS:
            raise ValueError(f"method: must be one of {CALIBRATION_METHODS}, got {method!r}")
        if self.absmax == 0:
            raise ValueError("batches: the quantizer saw only zeros; calibrate over real inputs")
        if method == "absmax":
            return self.absmax
        values = torch.cat(self.samples)
        if method == "percentile":
            return max(float(torch.quantile(values.abs(), percentile / 100)), 1e-12)
        candidates = self.absmax * torch.arange(1, MSE_GRID + 1) / MSE_GRID
        errors = [float((fake_quantize(values, c / QMAX[dtype], dtype) - values).pow(2).mean()) for c in candidates]
        return float(candidates[min(range(MSE_GRID), key=errors.__getitem__)])


def run_batches(model: nn.Module, batches: Iterable, description: str, progress: bool = True) -> int:
    """Forward every batch (input_ids [B, T], or a dict of model kwargs) without gradients; returns the count."""
    count = 0
    with torch.no_grad():
        for batch in tqdm(batches, desc=description, disable=not progress, leave=False):
            model(**batch) if isinstance(batch, dict) else model(batch)
            count += 1
    if count == 0:
        raise ValueError("batches: empty; calibration needs at least one batch")
    return count


def calibrate(model: nn.Module, batches: Iterable, method: str = "absmax", percentile: float = 99.99,
              progress: bool = True) -> dict[str, float]:
    """Set the scale of every static ActivationQuantizer of `model` from `batches`; returns {name: scale}."""
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"method: must be one of {CALIBRATION_METHODS}, got {method!r}")
    quantizers = {name: module for name, module in model.named_modules()
                  if isinstance(module, ActivationQuantizer) and module.mode == "static"}
    if not quantizers:
        raise ValueError("model: has no static activation quantizer (quantize it with a static recipe first)")
    stats = {name: ActivationStats(seed=i) for i, name in enumerate(quantizers)}
    for name, quantizer in quantizers.items():
        quantizer.observer = stats[name]
    try:
        run_batches(model, batches, f"calibrating ({method})", progress)
    finally:
        for quantizer in quantizers.values():
            quantizer.observer = None
    scales = {}
    for name, quantizer in quantizers.items():
        if not stats[name].samples:
            raise ValueError(f"batches: {name} saw no input; the calibration batches never reach it")
        scales[name] = stats[name].clip(method, quantizer.dtype, percentile) / QMAX[quantizer.dtype]
        quantizer.scale.fill_(scales[name])
    return scales


def channel_absmax(model: nn.Module, modules: dict[str, nn.Linear], batches: Iterable,
                   progress: bool = True) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel [in_features] of each given linear over `batches` (SmoothQuant's statistic)."""
    maxima = {name: torch.zeros(module.in_features) for name, module in modules.items()}

    def hook(name):
        def record(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            if x.shape[0]:
                maxima[name] = torch.maximum(maxima[name], x.abs().amax(dim=0).cpu())
        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in modules.items()]
    try:
        run_batches(model, batches, "SmoothQuant statistics", progress)
    finally:
        for handle in handles:
            handle.remove()
    return maxima
