"""from_pretrained's loader: a checkpoint directory -> a model of the class given, plain or quantized.

A plain directory loads through checkpoint.load_checkpoint (empty weights, checks, accelerate's dispatch, with
dtype / device_map / offload_folder); a quantized one (quantization_config in its config.json) through
quant/checkpoint_format.load_quantized_as, on the CPU as saved, so a packed checkpoint is never read as a
plain one; a transformers directory (config.json with a model_type) through interop.load.load_transformers.
The model class comes as an argument: nothing here imports model.py, which calls this.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from latentmoe_lab.checkpoint import check_load_dtype, load_checkpoint
from latentmoe_lab.checkpoint_checks import CONFIG_NAME, QUANT_KEY, resolve_checkpoint_dir
from latentmoe_lab.interop.detect import is_transformers_dir
from latentmoe_lab.textfile import read_text_file


def load_pretrained(model_class: type, path: str | Path, dtype: torch.dtype | None = None,
                    device_map: str | dict | None = None, offload_folder: str | Path | None = None,
                    verify_checksums: bool = True) -> torch.nn.Module:
    """`model_class` loaded from `path` in eval mode (arguments as checkpoint.load_checkpoint takes them)."""
    check_load_dtype(dtype)
    directory = resolve_checkpoint_dir(path)
    if is_transformers_dir(directory):  # config.json with a model_type: kimi_linear, deepseek_v32 (interop/)
        model = _load_transformers(model_class, directory, dtype, device_map, offload_folder)
    elif _is_quantized(directory):
        model = _load_quantized(model_class, directory, dtype, device_map, offload_folder, verify_checksums)
    else:
        model = load_checkpoint(model_class, directory, dtype=dtype, device_map=device_map,
                                offload_folder=offload_folder, verify_checksums=verify_checksums)
    model.name_or_path = str(directory)  # where tokenizer.tokenizer_of finds the checkpoint's tokenizer.json
    return model


def _load_transformers(model_class: type, directory: Path, dtype, device_map, offload_folder) -> torch.nn.Module:
    from latentmoe_lab.interop.load import load_transformers

    given = [name for name, value in (("device_map", device_map), ("offload_folder", offload_folder))
             if value is not None]
    if given:
        raise ValueError(f"{given[0]}: {directory} is a transformers checkpoint, which loads on the CPU; leave "
                         f"{', '.join(given)} unset (to keep its routed experts on disk: "
                         "latentmoe_lab.interop.offload.load_with_experts_on_disk)")
    return load_transformers(model_class, directory, dtype=dtype)


def _is_quantized(directory: Path) -> bool:
    try:
        data = json.loads(read_text_file(directory / CONFIG_NAME, "path"))
    except ValueError:
        return False  # ModelConfig.from_json reports what is wrong with the file
    return isinstance(data, dict) and QUANT_KEY in data


def _load_quantized(model_class: type, directory: Path, dtype, device_map, offload_folder,
                    verify_checksums: bool) -> torch.nn.Module:
    # Imported here, not at the top: importing latentmoe_lab.quant runs quant/__init__.py, whose public
    # load_quantized (quant/checkpoint.py) imports model.py, which imports this module.
    from latentmoe_lab.quant.checkpoint_format import load_quantized_as

    given = [name for name, value in (("dtype", dtype), ("device_map", device_map),
                                      ("offload_folder", offload_folder)) if value is not None]
    if given:
        raise ValueError(f"{given[0]}: {directory} is a quantized checkpoint, which loads on the CPU as saved; "
                         f"leave {', '.join(given)} unset (or call latentmoe_lab.quant.checkpoint.load_quantized)")
    return load_quantized_as(model_class, directory, verify_checksums=verify_checksums)
