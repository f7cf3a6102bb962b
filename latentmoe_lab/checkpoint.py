"""Checkpoints in the Hugging Face layout, safetensors only (docs/design.md §9).

    DIR/config.json                       ModelConfig.to_json()
    DIR/model.safetensors                 every tensor of the state dict, when it fits in max_shard_size
    DIR/model-0000k-of-0000n.safetensors  otherwise, shards of at most max_shard_size bytes each ...
    DIR/model.safetensors.index.json      ... and {"metadata": {"total_size"}, "weight_map": {name: shard}}
    DIR/checksums.json                    size and SHA-256 of each safetensors file and the index
    DIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json   the byte tokenizer for Hugging Face
                                          tools (tokenizer_files.py)

Saving goes only where checkpoint_dir.check_output_dir allows (never ".", "..", the working directory, a
root, a foreign non-empty directory or the source being read), and is atomic at the directory level:
everything is written (and fsynced) into a marked hidden sibling `.DIR.latentmoe-tmp-<pid>`, then the old
DIR is renamed to `DIR.previous`, the new one to DIR, and the previous one removed. A save killed at any
point leaves either DIR or `DIR.previous` complete, and `load` falls back to `DIR.previous` (with a
warning) in the one instant where DIR is missing. Files in DIR that are not part of a checkpoint are
carried over to the new directory.

Loading validates every file first (checkpoint_checks / checkpoint_integrity: regular files, one weights
layout, well-formed headers whose tensors tile the data), builds the model under accelerate's
`init_empty_weights` (no memory), checks names, shapes and dtypes against it and the files against
checksums.json, then calls `load_checkpoint_and_dispatch`, so a device map
("auto", {"layers.3": "disk", ...}) with CPU or disk offload works straight from a checkpoint.
Pickle-based files (.bin, .pt, ...) are refused: loading them can run arbitrary code.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from latentmoe_lab.checkpoint_checks import (CONFIG_NAME, INDEX_NAME, PICKLE_SUFFIXES, SHARD_RE, WEIGHTS_NAME,
                                             check_checkpoint, checked_files, resolve_checkpoint_dir)
from latentmoe_lab.checkpoint_dir import check_output_dir, swap_in, writing_temporary
from latentmoe_lab.checkpoint_integrity import CHECKSUMS_NAME, write_checksums
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.tokenizer_files import write_tokenizer_files

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """2_000_000_000, "2GB" (10^9) or "2GiB" (2^30) -> bytes (an int >= 1)."""
    if isinstance(size, bool):
        raise TypeError("max_shard_size: expected bytes as an int or a string like '2GB'")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str) and (match := _SIZE_RE.match(size)):
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    else:
        raise ValueError(f"max_shard_size: expected bytes or a string like '2GB' / '500MiB', got {size!r}")
    if value < 1:
        raise ValueError(f"max_shard_size: must be at least 1 byte, got {size!r}")
    return value


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict to write: contiguous CPU tensors, a tied LM head stored once (as the embedding)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def shard_state_dict(state: Mapping[str, torch.Tensor], max_shard_size: int) -> list[dict[str, torch.Tensor]]:
    """Greedy shards in state-dict order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_shard_size:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    return shards


def save_checkpoint(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "2GB",
                    extra_tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
                    extra_json: Mapping[str, object] | None = None,
                    config_fields: Mapping[str, object] | None = None) -> Path:
    """Write config.json + safetensors weights + checksums.json into `path`, atomically (module docstring).

    `path` must pass checkpoint_dir.check_output_dir. extra_tensors {file name: {key: tensor}} and
    extra_json {file name: object} go into the same directory in the same atomic step (the trainer state
    lives there); config_fields are added to config.json (a quantized model's recipe). Returns the directory.
    """
    path = check_output_dir(path)
    limit = parse_size(max_shard_size)
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"model: expected a model with a ModelConfig at .config, got {type(config).__name__}")
    for name in list(extra_tensors or {}) + list(extra_json or {}):
        if "/" in name or name.startswith(".") or _is_checkpoint_file(name) or name.endswith(PICKLE_SUFFIXES):
            raise ValueError(f"extra file {name!r}: must be a plain file name, not a weights / pickle name")
    with writing_temporary(path) as tmp:
        write_tokenizer_files(tmp, config.max_position_embeddings)
        (tmp / CONFIG_NAME).write_text(json.dumps({**config.to_dict(), **(config_fields or {})}, indent=2))
        shards = shard_state_dict(checkpoint_state_dict(model), limit)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for k, shard in enumerate(shards, start=1):
                file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / file), metadata={"format": "pt"})
                for name, tensor in shard.items():
                    weight_map[name] = file
                    total += tensor.numel() * tensor.element_size()
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        for file, tensors in (extra_tensors or {}).items():
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / file))
        for file, obj in (extra_json or {}).items():
            (tmp / file).write_text(json.dumps(obj))
        write_checksums(tmp, [p.name for p in tmp.iterdir() if p.suffix == ".safetensors" or p.name == INDEX_NAME])
        swap_in(tmp, path, carried_over=lambda name: not _is_checkpoint_file(name))
    return path


def _is_checkpoint_file(name: str) -> bool:
    """Files a save writes itself (an older directory's copies are replaced, never carried over)."""
    return name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, CHECKSUMS_NAME) or bool(SHARD_RE.fullmatch(name))


# ---------------------------------------------------------------------------------------------- loading
def check_load_dtype(dtype) -> None:
    """dtype: None or a floating torch.dtype (what a load may cast the floating parameters to)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")


def load_checkpoint(model_class: type, path: str | Path, dtype: torch.dtype | None = None,
                    device_map: str | dict | None = None, offload_folder: str | Path | None = None,
                    verify_checksums: bool = True) -> torch.nn.Module:
    """Build `model_class(config)` on empty weights and load the checkpoint at `path` into it (eval mode).

    dtype: cast floating parameters (the router's fp32 correction bias stays fp32); device_map: None (all on
    CPU), "auto" or a {module name: device | "cpu" | "disk"} dict as accelerate takes it; offload_folder:
    where "disk" entries go; verify_checksums: False skips the SHA-256 of each file (sizes are still checked).
    Plain checkpoints only: from_pretrained (pretrained.py) sends a quantized one to quant/ instead.
    """
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    check_load_dtype(dtype)
    directory = resolve_checkpoint_dir(path)
    checked = checked_files(directory)  # cheap, before building anything
    config = ModelConfig.from_json(directory / CONFIG_NAME)
    with init_empty_weights():
        model = model_class(config)
    model.tie_weights()  # init_empty_weights re-creates each parameter, which unties the LM head
    if dtype is not None:
        model.to(dtype)  # on meta tensors; accelerate then casts each loaded tensor to its parameter's dtype
    check_checkpoint(model, directory, checked, verify_checksums)
    model = load_checkpoint_and_dispatch(model, str(checked[0]),
                                         device_map={"": "cpu"} if device_map is None else device_map,
                                         no_split_module_classes=["DecoderBlock"], offload_folder=offload_folder,
                                         preload_module_classes=["DecoderBlock", "VisionTower"],
                                         offload_buffers=True)  # else an offloaded block keeps its init-time routing bias
    return model.eval()


def load_weights_into(model: torch.nn.Module, path: str | Path, verify_checksums: bool = True) -> Path:
    """Copy a checkpoint's tensors into an existing model (same config), checked like load_checkpoint.

    Returns the directory read. Used to resume training, where the model already exists.
    """
    from safetensors.torch import load_file

    directory = resolve_checkpoint_dir(path)
    checked = checked_files(directory)
    check_checkpoint(model, directory, checked, verify_checksums)
    state = {}
    for file in checked[1]:
        state.update(load_file(str(file)))
    # strict=False only for the tied LM head, which check_tensor_names already allowed to be absent
    model.load_state_dict(state, strict=False)
    return directory
