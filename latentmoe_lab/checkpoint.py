"""Checkpoints in the Hugging Face layout, safetensors only (docs/design.md §9).

    DIR/config.json                       ModelConfig.to_json()
    DIR/model.safetensors                 every tensor of the state dict, when it fits in max_shard_size
    DIR/model-0000k-of-0000n.safetensors  otherwise, shards of at most max_shard_size bytes each ...
    DIR/model.safetensors.index.json      ... and {"metadata": {"total_size"}, "weight_map": {name: shard}}
    DIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json   the byte tokenizer for Hugging Face
                                          tools (tokenizer_files.py)

Saving is atomic at the directory level: everything is written (and fsynced) into a hidden sibling
`.DIR.tmp-<pid>`, then the old DIR is renamed to `DIR.previous`, the new one to DIR, and the previous
one removed. A save killed at any point leaves either DIR or `DIR.previous` complete, and `load` falls
back to `DIR.previous` (with a warning) in the one instant where DIR is missing. Files in DIR that are
not part of a checkpoint are carried over to the new directory.

Loading builds the model under accelerate's `init_empty_weights` (no memory), checks the names and
shapes in the safetensors headers against it, then calls `load_checkpoint_and_dispatch`, so a device
map ("auto", {"layers.3": "disk", ...}) with CPU or disk offload works straight from a checkpoint.
Pickle-based files (.bin, .pt, ...) are refused: loading them can run arbitrary code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.tokenizer_files import write_tokenizer_files

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
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
                    extra_json: Mapping[str, object] | None = None) -> Path:
    """Write config.json + safetensors weights into `path`, atomically (see the module docstring).

    extra_tensors {file name: {key: tensor}} and extra_json {file name: object} go into the same
    directory in the same atomic step (the trainer state lives there). Returns the directory.
    """
    path = Path(path)
    limit = parse_size(max_shard_size)
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"model: expected a model with a ModelConfig at .config, got {type(config).__name__}")
    for name in list(extra_tensors or {}) + list(extra_json or {}):
        if "/" in name or name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) or name.endswith(PICKLE_SUFFIXES):
            raise ValueError(f"extra file {name!r}: must be a plain file name, not a weights / pickle name")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_tokenizer_files(tmp, config.max_position_embeddings)
    (tmp / CONFIG_NAME).write_text(config.to_json())
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
    _fsync_tree(tmp)
    _swap_in(tmp, path)
    return path


def _is_checkpoint_file(name: str, extra: set[str]) -> bool:
    return name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) or bool(_SHARD_RE.fullmatch(name)) or name in extra


def _swap_in(tmp: Path, path: Path) -> None:
    previous = path.parent / f"{path.name}.previous"
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"path: {path} exists and is not a directory")
        written = {entry.name for entry in tmp.iterdir()}
        for entry in path.iterdir():  # carry over what is not ours (a README, a trainer log, ...)
            if not _is_checkpoint_file(entry.name, written) and not entry.name.endswith(".previous"):
                os.rename(entry, tmp / entry.name)
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(path, previous)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _remove_stale_temporaries(path: Path) -> None:
    """Temporary directories left by saves that were killed (their process no longer exists)."""
    for entry in path.parent.glob(f".{path.name}.tmp-*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- loading
def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The directory to read: `path`, or `path.previous` when a save was interrupted between its renames."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG_NAME).exists():
        return path
    previous = path.parent / f"{path.name}.previous"
    if not path.exists() and (previous / CONFIG_NAME).exists():
        warnings.warn(f"{path} is missing but {previous} is complete (a save was interrupted); loading it",
                      stacklevel=3)
        return previous
    if not path.exists():
        raise FileNotFoundError(f"path: no checkpoint directory at {path}")
    if not path.is_dir():
        raise ValueError(f"path: {path} is a file; from_pretrained takes the checkpoint directory")
    raise ValueError(f"path: {path} has no {CONFIG_NAME}; not a checkpoint written by save_pretrained")


def refuse_pickle(directory: Path) -> None:
    """Raise if the directory holds a pickle-based weights file (torch.load would execute it)."""
    found = sorted(entry.name for entry in directory.iterdir() if entry.name.lower().endswith(PICKLE_SUFFIXES))
    if found:
        raise ValueError(f"path: {directory} holds pickle-based files {found}; only safetensors checkpoints are "
                         f"loaded (pickle can run arbitrary code). Convert them with safetensors.torch.save_file.")


def weight_files(directory: Path) -> tuple[Path, list[Path]]:
    """(what to hand to accelerate: the single file or the index json, the safetensors files it names)."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"path: {index} has no 'weight_map' of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
        bad = [f for f in files if not f.endswith(".safetensors") or "/" in f]
        if bad:
            raise ValueError(f"path: {index} points at non-safetensors files {bad}; only safetensors are loaded")
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise ValueError(f"path: {index} names shard files that are missing: {missing}")
        return index, [directory / f for f in files]
    single = directory / WEIGHTS_NAME
    if single.exists():
        return single, [single]
    raise ValueError(f"path: {directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers only (no tensor data is read)."""
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_tensor_names(model: torch.nn.Module, stored: Mapping[str, tuple[int, ...]]) -> None:
    """ValueError naming the missing and unexpected tensors and every shape mismatch."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    mismatched = [f"{name}: checkpoint {list(stored[name])} vs model {list(expected[name])}"
                  for name in sorted(set(expected) & set(stored)) if stored[name] != expected[name]]
    problems = []
    if missing:
        problems.append(f"missing tensors {_shorten(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_shorten(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {_shorten(mismatched)}")
    if problems:
        raise ValueError("checkpoint does not match the model built from its config.json: " + "; ".join(problems))


def _shorten(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', ... ({len(items) - limit} more)' if len(items) > limit else ''}]"


def load_checkpoint(model_class: type, path: str | Path, dtype: torch.dtype | None = None,
                    device_map: str | dict | None = None, offload_folder: str | Path | None = None) -> torch.nn.Module:
    """Build `model_class(config)` on empty weights and load the checkpoint at `path` into it (eval mode).

    dtype: cast floating parameters (the router's fp32 correction bias stays fp32); device_map: None (all on
    CPU), "auto" or a {module name: device | "cpu" | "disk"} dict as accelerate takes it; offload_folder:
    where "disk" entries go.
    """
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")
    directory = resolve_checkpoint_dir(path)
    refuse_pickle(directory)
    config = ModelConfig.from_json(directory / CONFIG_NAME)
    entry, files = weight_files(directory)
    with init_empty_weights():
        model = model_class(config)
    model.tie_weights()  # init_empty_weights re-creates each parameter, which unties the LM head
    if dtype is not None:
        model.to(dtype)  # on meta tensors; accelerate then casts each loaded tensor to its parameter's dtype
    check_tensor_names(model, stored_shapes(files))
    model = load_checkpoint_and_dispatch(model, str(entry), device_map={"": "cpu"} if device_map is None else device_map,
                                         no_split_module_classes=["DecoderBlock"], offload_folder=offload_folder,
                                         preload_module_classes=["DecoderBlock", "VisionTower"],
                                         offload_buffers=True)  # else an offloaded block keeps its init-time routing bias
    return model.eval()


def load_weights_into(model: torch.nn.Module, path: str | Path) -> Path:
    """Copy a checkpoint's tensors into an existing model (same config), checked like load_checkpoint.

    Returns the directory read. Used to resume training, where the model already exists.
    """
    from safetensors.torch import load_file

    directory = resolve_checkpoint_dir(path)
    refuse_pickle(directory)
    _, files = weight_files(directory)
    check_tensor_names(model, stored_shapes(files))
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    # strict=False only for the tied LM head, which check_tensor_names already allowed to be absent
    model.load_state_dict(state, strict=False)
    return directory
