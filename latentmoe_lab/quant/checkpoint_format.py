"""The checkpoint format of quantized models, for any model class (docs/design.md §7, §9): packed tensors +
scales in safetensors, the recipe in config.json under "quantization_config".

Built on latentmoe_lab/checkpoint.py from outside: `save_checkpoint` writes the state dict (uint8 / int8 packed
weights, fp32 scales, calibrated activation scales, SmoothQuant factors and the high-precision parameters, all
as they are held) and config.json with the recipe, in one atomic step, with the same output-directory rules
and checksums as any checkpoint. Loading validates the files (headers, checksums), builds the model on empty
weights, re-creates the packed modules empty from the recipe, checks names, shapes and dtypes against the
files, and assigns the stored tensors: a round trip is bit-identical. `LatentMoEForCausalLM.from_pretrained`
on a quantized directory comes here (pretrained.py), so a packed checkpoint is never read as a plain one; the
model class is an argument, so this module never imports model.py (quant/checkpoint.py's load_quantized does).
"""
from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from latentmoe_lab.checkpoint import save_checkpoint
from latentmoe_lab.checkpoint_checks import (CONFIG_NAME, QUANT_KEY, check_checkpoint, checked_files,
                                             resolve_checkpoint_dir)
from latentmoe_lab.checkpoint_integrity import read_json_file
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.quant.linear import QuantLinear
from latentmoe_lab.quant.quantize import quantize_model
from latentmoe_lab.quant.recipes import Recipe


def save_quantized(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "2GB") -> Path:
    """Write a quantized model (quant.quantize_model) to `path`; returns the directory."""
    recipe = getattr(model, "quant_recipe", None)
    if not isinstance(recipe, Recipe):
        raise ValueError("model: not quantized (no quant_recipe); save it with model.save_pretrained instead")
    return save_checkpoint(model, path, max_shard_size, config_fields={QUANT_KEY: recipe.to_dict()})


def read_quantized_config(path: str | Path) -> tuple[ModelConfig, Recipe, Path]:
    """(model config, recipe, directory) of a quantized checkpoint."""
    directory = resolve_checkpoint_dir(path)
    config_path = directory / CONFIG_NAME
    data = read_json_file(config_path)
    if not isinstance(data, dict) or QUANT_KEY not in data:
        raise ValueError(f"path: {directory} holds a plain checkpoint (no {QUANT_KEY} in {CONFIG_NAME}); "
                         "load it with LatentMoEForCausalLM.from_pretrained")
    try:
        recipe = Recipe.from_dict(data.pop(QUANT_KEY))
    except (TypeError, ValueError) as error:  # the recipe names the field; say which file and section
        raise ValueError(f"checkpoint file {config_path}: {QUANT_KEY}.{error}") from None
    return ModelConfig.from_dict(data), recipe, directory


def load_quantized_as(model_class: type, path: str | Path, verify_checksums: bool = True) -> torch.nn.Module:
    """The quantized `model_class(config)` saved at `path`, on the CPU, in eval mode, every tensor exactly as saved.

    verify_checksums=False skips the SHA-256 of each file (for very large checkpoints; sizes are still checked).
    """
    config, recipe, directory = read_quantized_config(path)
    checked = checked_files(directory)
    with init_empty_weights():
        model = model_class(config)
    model.tie_weights()
    quantize_model(model, recipe, pack=False)  # packed modules with empty (meta) buffers
    check_checkpoint(model, directory, checked, verify_checksums)
    state = {}
    for file in checked[1]:
        state.update(load_file(str(file)))
    model.load_state_dict(state, strict=False, assign=True)  # strict=False: a tied LM head is stored once
    model.tie_weights()
    dtype = model.embed_tokens.weight.dtype
    for module in model.modules():  # the dtype probes are not saved; they follow the loaded weights
        if isinstance(module, QuantLinear):
            module._dtype_probe = torch.empty(0, dtype=dtype)
    return model.eval()
