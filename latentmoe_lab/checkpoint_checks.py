"""What a save_pretrained directory must hold before anything is loaded from it (checkpoint.py loads).

Which directory (DIR, or DIR.previous after an interrupted save), no pickle files, exactly one weights
layout (model.safetensors, or shards with an index that names each shard and where each tensor is), every
header validated (checkpoint_integrity), the tensors' names, shapes and dtypes against the model built from
config.json, then the files against checksums.json. Each failure is a one-line ValueError naming the file
or directory and the tensor.
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from latentmoe_lab.checkpoint_integrity import dtype_mismatch, read_json_file, stored_tensors, verify_files

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
QUANT_KEY = "quantization_config"  # in config.json: the quantization recipe of a quantized checkpoint (quant/)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def resolve_checkpoint_dir(path: str | Path, name: str = "path") -> Path:
    """The directory to read: `path`, or `path.previous` when a save was interrupted between its renames."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a checkpoint directory path, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir() and (path / CONFIG_NAME).exists():
        return path
    previous = path.parent / f"{path.name}.previous"
    if not path.exists() and (previous / CONFIG_NAME).exists():
        warnings.warn(f"{path} is missing but {previous} is complete (a save was interrupted); loading it",
                      stacklevel=3)
        return previous
    if not path.exists():
        raise FileNotFoundError(f"{name}: no checkpoint directory at {path}")
    if not path.is_dir():
        raise ValueError(f"{name}: {path} is a file; a checkpoint is a directory")
    raise ValueError(f"{name}: {path} has no {CONFIG_NAME}; not a checkpoint written by save_pretrained")


def refuse_pickle(directory: Path) -> None:
    """Raise if the directory holds a pickle-based weights file (torch.load would execute it)."""
    found = sorted(entry.name for entry in directory.iterdir() if entry.name.lower().endswith(PICKLE_SUFFIXES))
    if found:
        raise ValueError(f"path: {directory} holds pickle-based files {found}; only safetensors checkpoints are "
                         f"loaded (pickle can run arbitrary code). Convert them with safetensors.torch.save_file.")


def weight_files(directory: Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """(what to hand to accelerate: the single file or the index json, the safetensors files it names,
    the index's weight_map or None). Exactly one layout may be present: a model.safetensors beside shard
    files, or shard files the index does not name, are refused (a stale file must not be loaded)."""
    index, single = directory / INDEX_NAME, directory / WEIGHTS_NAME
    shards = sorted(p.name for p in directory.iterdir() if SHARD_RE.fullmatch(p.name))
    if index.exists() or index.is_symlink():
        if single.exists() or single.is_symlink():
            raise ValueError(f"checkpoint file {single}: beside {INDEX_NAME} (a save writes one or the other; "
                             f"a stale file?); remove the one that does not belong")
        data = read_json_file(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"checkpoint file {index}: no 'weight_map' of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
        bad = [f for f in files if not f.endswith(".safetensors") or "/" in f or f.startswith(".")]
        if bad:
            raise ValueError(f"checkpoint file {index}: points at non-safetensors files {bad}; only safetensors "
                             f"are loaded")
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise ValueError(f"checkpoint file {index}: names shard files that are missing: {missing}")
        strays = sorted(set(shards) - set(files))
        if strays:
            raise ValueError(f"checkpoint file {directory / strays[0]}: a shard file {INDEX_NAME} does not name "
                             f"(a stale file?)")
        return index, [directory / f for f in files], weight_map
    if single.exists() or single.is_symlink():
        if shards:
            raise ValueError(f"checkpoint file {single}: beside shard files {_shorten(shards)} but no {INDEX_NAME} "
                             f"(a stale file?); remove the one that does not belong")
        return single, [single], None
    raise ValueError(f"path: {directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def checked_files(directory: Path) -> tuple[Path, list[Path], dict]:
    """weight_files, then every header validated (checkpoint_integrity) and the index's weight_map checked
    against the headers. Returns (entry, files, stored_tensors)."""
    refuse_pickle(directory)
    entry, files, weight_map = weight_files(directory)
    stored = stored_tensors(files)
    if weight_map is not None:
        for name, (_, _, file) in stored.items():
            if weight_map.get(name) != file.name:
                raise ValueError(f"checkpoint file {file}: tensor {name!r} is not where {INDEX_NAME} puts it "
                                 f"({weight_map.get(name)})")
        absent = sorted(set(weight_map) - set(stored))
        if absent:
            raise ValueError(f"checkpoint file {directory / weight_map[absent[0]]}: tensor {absent[0]!r} named "
                             f"by {INDEX_NAME} is not in it")
    return entry, files, stored


def check_checkpoint(model: torch.nn.Module | None, directory: Path, checked: tuple[Path, list[Path], dict],
                     verify_checksums: bool = True) -> None:
    """After checked_files (`checked`, done before the model is built), the rest of what a load checks before
    reading tensor data, most specific error first: the tensors against `model` unless None
    (check_tensor_names), then the files against checksums.json (verify_files)."""
    entry, files, stored = checked
    if model is not None:
        check_tensor_names(model, stored, directory)
    verify_files(directory, files + ([entry] if entry.name == INDEX_NAME else []), verify_checksums)


def check_tensor_names(model: torch.nn.Module, stored: Mapping[str, tuple[str, tuple[int, ...], Path]],
                       directory: Path) -> None:
    """ValueError naming `directory`, the missing and unexpected tensors, every shape mismatch and every dtype
    that may not load into the model's (checkpoint_integrity.dtype_mismatch). stored: stored_tensors()."""
    state = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in state.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    common = sorted(set(expected) & set(stored))
    mismatched = [f"{name}: checkpoint {list(stored[name][1])} in {stored[name][2].name} vs model "
                  f"{list(expected[name])}"
                  for name in common if stored[name][1] != expected[name]]
    wrong_dtype = [f"{name}: checkpoint {stored[name][0]} in {stored[name][2].name} vs model "
                   f"{str(state[name].dtype).removeprefix('torch.')}"
                   for name in common if dtype_mismatch(stored[name][0], state[name].dtype)]
    problems = []
    if missing:
        problems.append(f"missing tensors {_shorten(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_shorten(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {_shorten(mismatched)}")
    if wrong_dtype:
        problems.append(f"dtype mismatches {_shorten(wrong_dtype)}")
    if problems:
        raise ValueError(f"checkpoint {directory} does not match the model built from its config.json: "
                         + "; ".join(problems))


def _shorten(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', ... ({len(items) - limit} more)' if len(items) > limit else ''}]"
