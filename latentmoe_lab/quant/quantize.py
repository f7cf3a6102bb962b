"""quantize_model: swap a model's linears and routed experts for packed ones, following a recipe (docs/design.md §7).

Modules are replaced from outside, in place (the layers are not edited): each eligible nn.Linear becomes a
QuantLinear, each LatentMoE's `experts` a QuantLatentExperts. What the recipe leaves out, and what stays high
precision by rule (quant/recipes.py), keeps its parameters untouched. The recipe is remembered as
`model.quant_recipe` (checkpoints write it into config.json).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.param_components import component_of
from latentmoe_lab.quant.activations import ActivationQuantizer
from latentmoe_lab.quant.calibration import calibrate, channel_absmax
from latentmoe_lab.quant.experts import QuantLatentExperts
from latentmoe_lab.quant.linear import QuantLinear
from latentmoe_lab.quant.recipes import Recipe, get_recipe

SMOOTH_FLOOR = 1e-5  # keeps s_j > 0 for a channel that never fired


def quantization_targets(model: nn.Module, recipe: Recipe) -> dict[str, tuple[nn.Module, str]]:
    """{module name: (module, format)} for every nn.Linear / LatentExperts the recipe packs."""
    targets = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            param_name = f"{name}.weight"
        elif isinstance(module, LatentExperts):
            param_name = f"{name}.w13"
        else:
            continue
        fmt = recipe.weight_format(component_of(param_name, model), param_name)
        if fmt is not None:
            targets[name] = (module, fmt)
    return targets


def _activation(recipe: Recipe, name: str, in_features: int, smooth: torch.Tensor | None = None,
                smoothing: bool = False) -> ActivationQuantizer | None:
    """The recipe's activation quantizer for module `name`'s input (None: weight-only), smooth factors set."""
    if not recipe.quantizes_activations(name):
        return None
    quantizer = ActivationQuantizer(recipe.activations, recipe.act_dtype, in_features, smoothing)
    if smooth is not None:
        quantizer.smooth.copy_(smooth)
    return quantizer


def smoothing_factors(linear: nn.Linear, x_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant s_j = absmax(x_j)^alpha / absmax(W_:,j)^(1 - alpha), [in_features] fp32."""
    w_absmax = linear.weight.detach().float().abs().amax(dim=0).cpu()
    return (x_absmax.clamp(min=SMOOTH_FLOOR).pow(alpha) / w_absmax.clamp(min=SMOOTH_FLOOR).pow(1 - alpha)
            ).clamp(min=SMOOTH_FLOOR).to(linear.weight.device)


def quantize_model(model: nn.Module, recipe: "str | Recipe | dict", batches: Iterable | None = None,
                   progress: bool = True, pack: bool = True) -> nn.Module:
    """Quantize `model` in place by `recipe` (a Recipe, its dict or a name in quant.RECIPES); returns it.

    batches: calibration inputs (input_ids [B, T] or dicts of model kwargs); required by SmoothQuant, and
    with a static recipe they also calibrate the activation scales. Without them a static model needs
    `quant.calibrate` before its first forward. pack=False builds the packed modules empty (for loading a
    checkpoint into them).
    """
    recipe = get_recipe(recipe)
    if getattr(model, "quant_recipe", None) is not None:
        raise ValueError(f"model: already quantized with recipe {model.quant_recipe.name!r}")
    batches = None if batches is None else list(batches)
    targets = quantization_targets(model, recipe)
    smooth = {}
    if recipe.smooth_alpha is not None and pack:
        if not batches:
            raise ValueError("batches: SmoothQuant (recipe.smooth_alpha) needs calibration batches")
        linears = {name: module for name, (module, _) in targets.items()
                   if isinstance(module, nn.Linear) and recipe.quantizes_activations(name)}
        stats = channel_absmax(model, linears, batches, progress)
        smooth = {name: smoothing_factors(linears[name], stats[name], recipe.smooth_alpha) for name in linears}
    for name, (module, fmt) in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(module, LatentExperts):
            _, latent, two_inter = module.w13.shape
            act13, act2 = _activation(recipe, name, latent), _activation(recipe, name, two_inter // 2)
            new = (QuantLatentExperts.from_experts(module, fmt, act13, act2) if pack else
                   QuantLatentExperts(module.w13.shape[0], latent, two_inter // 2, fmt, module.activation_clamp,
                                      act13, act2, module.w13.device, module.situ_betas))
        else:
            act = _activation(recipe, name, module.in_features, smooth.get(name), recipe.smooth_alpha is not None)
            new = (QuantLinear.from_linear(module, fmt, act) if pack else
                   QuantLinear(module.in_features, module.out_features, fmt, act, module.weight.dtype,
                               module.weight.device))
        setattr(parent, child, new)
    model.quant_recipe = recipe
    if recipe.activations == "static" and batches and pack:
        calibrate(model, batches, recipe.calibration, recipe.percentile, progress)
    return model


def held_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (what meta.recipe_bytes predicts)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
