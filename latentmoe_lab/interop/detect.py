"""Which format a checkpoint directory is in, and the architecture module that reads a transformers one.

A transformers config.json names its architecture in "model_type"; our own config.json (ModelConfig.to_dict())
never has that key, so its absence is our format's marker (docs/design.md §17).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from latentmoe_lab.checkpoint_checks import CONFIG_NAME
from latentmoe_lab.config_fields import describe
from latentmoe_lab.textfile import read_text_file

# model_type -> module with MODEL_TYPE, config_from_hf, config_to_hf and name_table
ARCHITECTURES = {
    "kimi_linear": "latentmoe_lab.interop.kimi_linear",
    "deepseek_v32": "latentmoe_lab.interop.deepseek_v32",
    "kimi_k3": "latentmoe_lab.interop.k3",
}
# model_type -> (module, loader(model_class, path, dtype=), writer(model, path)) for formats with storage rules of
# their own (K3: padded A_log, MXFP4 experts): load.load_transformers and export.export_transformers hand those
# directories over whole.
OWN_FORMATS = {"kimi_k3": ("latentmoe_lab.interop.k3_checkpoint", "load_k3", "save_k3")}
_MISSING = object()


def format_loader(model_type: str):
    """The loader of a format with its own storage rules (OWN_FORMATS), or None for the generic name-table path."""
    return _own_format(model_type, 1)


def format_writer(model_type: str):
    """The writer of a format with its own storage rules (OWN_FORMATS), or None for the generic path."""
    return _own_format(model_type, 2)


def _own_format(model_type: str, which: int):
    if model_type not in OWN_FORMATS:
        return None
    return getattr(importlib.import_module(OWN_FORMATS[model_type][0]), OWN_FORMATS[model_type][which])


def supported_types() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def architecture(model_type: Any) -> ModuleType:
    """The interop module for a transformers model_type; any other -> ValueError naming the supported types."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type: {describe(model_type)} is not supported; supported: {supported_types()}")
    return importlib.import_module(ARCHITECTURES[model_type])


def read_config_json(directory: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory (a JSON object, at most 1 MiB)."""
    path = Path(directory) / CONFIG_NAME
    try:
        data = json.loads(read_text_file(path, "path"))
    except json.JSONDecodeError as error:
        raise ValueError(f"path: {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"path: {path} holds {type(data).__name__}, not a JSON object")
    return data


def is_transformers_dir(directory: str | Path) -> bool:
    """True when `directory` has a config.json with a "model_type" (transformers' format, not ours)."""
    path = Path(directory)
    if not (path / CONFIG_NAME).is_file():
        return False
    return "model_type" in read_config_json(path)


def hf_value(hf: dict[str, Any], *names: str, default: Any = _MISSING) -> Any:
    """The first of `names` present in a transformers config dict (canonical name first, then the aliases its
    attribute_map writes); `default` when none is, or ValueError naming the first name when no default."""
    for name in names:
        if name in hf:
            return hf[name]
    if default is _MISSING:
        raise ValueError(f"{names[0]}: missing from config.json (required)")
    return default
