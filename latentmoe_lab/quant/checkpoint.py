"""Checkpoints of quantized models (docs/design.md §7, §9): packed tensors + scales in safetensors, the recipe
in config.json under "quantization_config".

Built on latentmoe_lab/checkpoint.py from outside: `save_checkpoint` writes the state dict (uint8 / int8 packed
weights, fp32 scales, calibrated activation scales, SmoothQuant factors and the high-precision parameters, all
as they are held) atomically; then config.json is replaced, atomically as a file, by the same config plus the
recipe. A save killed between the two leaves a config without the recipe, whose packed tensor names the plain
loader refuses (no silent mix-up). Loading builds the model on empty weights, re-creates the packed modules
empty from the recipe, checks names and shapes against the files, and assigns the stored tensors: a round trip
is bit-identical. `LatentMoEForCausalLM.from_pretrained` refuses a quantized directory ("quantization_config:
unknown config field"), so a packed checkpoint is never read as a plain one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from latentmoe_lab.checkpoint import (CONFIG_NAME, check_tensor_names, refuse_pickle, resolve_checkpoint_dir,
                                      save_checkpoint, stored_shapes, weight_files)
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.quant.linear import QuantLinear
from latentmoe_lab.quant.quantize import quantize_model
from latentmoe_lab.quant.recipes import Recipe

QUANT_KEY = "quantization_config"


def save_quantized(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "2GB") -> Path:
    """Write a quantized model (quant.quantize_model) to `path`; returns the directory."""
    recipe = getattr(model, "quant_recipe", None)
    if not isinstance(recipe, Recipe):
        raise ValueError("model: not quantized (no quant_recipe); save it with model.save_pretrained instead")
    directory = save_checkpoint(model, path, max_shard_size)
    config = {**model.config.to_dict(), QUANT_KEY: recipe.to_dict()}
    tmp = directory / f".{CONFIG_NAME}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(json.dumps(config, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / CONFIG_NAME)
    return directory


def read_quantized_config(path: str | Path) -> tuple[ModelConfig, Recipe, Path]:
    """(model config, recipe, directory) of a quantized checkpoint."""
    directory = resolve_checkpoint_dir(path)
    data = json.loads((directory / CONFIG_NAME).read_text())
    if QUANT_KEY not in data:
        raise ValueError(f"path: {directory} holds a plain checkpoint (no {QUANT_KEY} in {CONFIG_NAME}); "
                         "load it with LatentMoEForCausalLM.from_pretrained")
    recipe = Recipe.from_dict(data.pop(QUANT_KEY))
    return ModelConfig.from_dict(data), recipe, directory


def load_quantized(path: str | Path) -> torch.nn.Module:
    """The quantized model saved at `path`, on the CPU, in eval mode, with every tensor exactly as saved."""
    from latentmoe_lab.model import LatentMoEForCausalLM

    config, recipe, directory = read_quantized_config(path)
    refuse_pickle(directory)
    _, files = weight_files(directory)
    with init_empty_weights():
        model = LatentMoEForCausalLM(config)
    model.tie_weights()
    quantize_model(model, recipe, pack=False)  # packed modules with empty (meta) buffers
    check_tensor_names(model, stored_shapes(files))
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    model.load_state_dict(state, strict=False, assign=True)  # strict=False: a tied LM head is stored once
    model.tie_weights()
    dtype = model.embed_tokens.weight.dtype
    for module in model.modules():  # the dtype probes are not saved; they follow the loaded weights
        if isinstance(module, QuantLinear):
            module._dtype_probe = torch.empty(0, dtype=dtype)
    return model.eval()
