"""Distributed checkpoints of a NativeModel: sharded safetensors through torch.distributed.checkpoint, no pickle.

    DIR/config.json           ModelConfig.to_json() of the model
    DIR/checkpoint.json       the manifest: format, whether an optimizer was saved, the extra JSON file names,
                              and every file's size in bytes (a truncated or missing file is caught before reading)
    DIR/model/shard-<r+1>-model-00001-of-00001.safetensors
                              rank r's chunks of the model state dict under the plain parameter names; the
                              safetensors header's DCP_SHARDING_INFO gives each chunk's offset in the global tensor
    DIR/optimizer/shard-...   the same for the optimizer's tensors, named "<param>.exp_avg", "<param>.step", ...
    DIR/optimizer.json        the param_groups' hyperparameters (lr, betas, initial_lr, ...) in group order, without
                              the parameter names (a pipeline stage knows only its own)
    DIR/<name>.json           each extra_json entry (the trainer's step, scheduler, history, ...)

Saving: every rank writes only its own chunks (HuggingFaceStorageWriter(save_distributed=True); a replicated
tensor is written once, by the rank DCP's de-duplication picks). DCP's default FileSystemWriter pickles its
.metadata file and any non-tensor value; here the sharding metadata lives in the safetensors headers and
everything else is JSON, so the directory holds no pickle. Atomic like latentmoe_lab/checkpoint.py: the
ranks write into `.DIR.latentmoe-tmp-<pid of rank 0>` (checkpoint_dir: only where check_output_dir allows,
marked as ours), and after a barrier rank 0 moves the old DIR to DIR.previous,
the new one to DIR, and removes the previous one. The directory belongs to the checkpoint as a whole:
nothing of an older save is carried over (a stale optimizer state must not outlive its weights).

Loading reshards: any NativeLayout, or a plain single-process module with no process group at all,
states the chunks it wants (its DTensor local shards, or whole tensors) and HuggingFaceStorageReader
reads only the overlapping slices (safetensors get_slice). Before anything is read, every file is checked
(each rank checks the same files, so all of them raise together instead of one waiting in a collective):
regular files, safetensors or JSON by their bytes, never a pickle; the sizes and SHA-256 digests the manifest
recorded (verify_checksums=False skips the digests); well-formed headers; chunks that cover each tensor; then
every tensor of the target must be in the checkpoint with its global shape. Expert stacks held in an EPLB
placement's slot order are written and read in logical order (native/eplb.py), so the files are
the same whatever the placement. An optimizer's state loads
per parameter; one that had no state at the save (it never had a gradient) has none after the load.
See docs/design.md §11.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from latentmoe_lab.checkpoint import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, parse_size, shard_state_dict
from latentmoe_lab.checkpoint_dir import (MARKER_NAME, check_output_dir, make_temporary, swap_in, temporary_path,
                                          writing_temporary)
from latentmoe_lab.checkpoint_integrity import file_sha256, read_json_file, write_checksums
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.native.build import NativeModel, load_local_shards
from latentmoe_lab.native.eplb import (copy_to_slots, logical_shapes, logical_targets, placed_layers,
                                                   to_logical)
from latentmoe_lab.native.checkpoint_files import (RESERVED_NAMES, FORMAT, MANIFEST_NAME, MODEL_DIR, OPTIMIZER_DIR,
                                                   OPTIMIZER_JSON, SHARDED, check_sharded)
from latentmoe_lab.tokenizer_files import write_tokenizer_files


# ---------------------------------------------------------------------------------------------- saving
def save_sharded(native: NativeModel, directory: str | Path, optimizer: torch.optim.Optimizer | None = None,
                 extra_json: dict | None = None) -> Path:
    """Collective: every rank of the NativeModel's mesh calls it. Writes DIR as the module docstring lists."""
    if not isinstance(native, NativeModel):
        raise TypeError(f"native: expected a NativeModel (build_native), got {type(native).__name__}")
    directory = check_output_dir(directory, name="directory", kind=SHARDED)
    texts = {name: _to_json(f"extra_json: {name!r}", value) for name, value in _checked_extras(extra_json).items()}
    device = native.device
    rank0 = dist.get_rank() == 0
    tmp = temporary_path(directory, _broadcast_int(os.getpid(), device))
    if rank0:
        make_temporary(directory)
        (tmp / MODEL_DIR).mkdir()
    dist.barrier()
    # expert stacks in an EPLB placement's slot order go to disk in logical order (native/eplb.py)
    placed, num_experts = placed_layers(native.module), native.module.config.moe.num_experts
    _dcp_save(to_logical(get_model_state_dict(native.module), placed, num_experts), tmp / MODEL_DIR)
    if optimizer is not None:
        state = get_optimizer_state_dict(native.module, optimizer)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
        texts[OPTIMIZER_JSON] = _to_json("optimizer: the param_groups hyperparameters", groups)
        _dcp_save(to_logical(flatten_optimizer_state(state["state"]), placed, num_experts), tmp / OPTIMIZER_DIR)
    dist.barrier()  # every rank's shards are on disk
    failure = ""
    if rank0:
        try:
            _finish(tmp, directory, native.module.config, texts, sorted(extra_json or {}))
        except Exception as error:  # noqa: BLE001 - reported to every rank below, then raised here
            failure = f"{type(error).__name__}: {error}"
            shutil.rmtree(tmp, ignore_errors=True)
    if _broadcast_int(int(bool(failure)), device):
        raise RuntimeError(f"save_sharded: rank 0 could not finish {directory}: {failure or 'see rank 0'}")
    return directory


def _checked_extras(extra_json: dict | None) -> dict:
    extra_json = dict(extra_json or {})
    for name in extra_json:
        if not isinstance(name, str) or "/" in name or name.startswith(".") or name in RESERVED_NAMES \
                or not name.endswith(".json"):
            raise ValueError(f"extra_json: file name {name!r} must be a plain '*.json' name other than "
                             f"{sorted(n for n in RESERVED_NAMES if n.endswith('.json'))}")
    return extra_json


def _to_json(what: str, value) -> str:
    """Serialised on every rank before the step that needs it, so a bad value fails on all ranks at once."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} is not JSON-serialisable ({error})") from None


def flatten_optimizer_state(state: dict) -> dict[str, torch.Tensor]:
    """{param: {"exp_avg": t, "step": t, ...}} -> {"param.exp_avg": t, ...}; a non-tensor value is refused."""
    flat = {}
    for param, values in state.items():
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer: state {param!r}[{key!r}] is a {type(value).__name__}; only tensors "
                                f"are checkpointed (a safetensors file holds nothing else)")
            flat[f"{param}.{key}"] = value
    return flat


def _dcp_save(state: dict, path: Path) -> None:
    # the safetensors writer would copy a non-tensor value's pickled bytes into the file: refuse them
    wrong = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if wrong:
        raise TypeError(f"state dict: non-tensor entries {wrong[:8]} cannot go into safetensors")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True))


def _finish(tmp: Path, directory: Path, config: ModelConfig, texts: dict[str, str], extra_names: list[str]) -> None:
    """Rank 0, after every rank wrote its shards: the JSON files, the manifest, fsync, the atomic swap."""
    (tmp / CONFIG_NAME).write_text(config.to_json())
    for name, text in texts.items():
        (tmp / name).write_text(text)
    written = [p for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != MARKER_NAME]
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in written}
    manifest = {"format": FORMAT, "optimizer": OPTIMIZER_JSON in texts, "extra_json": extra_names, "files": files,
                "sha256": {str(p.relative_to(tmp)): file_sha256(p) for p in written}}
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    swap_in(tmp, directory)  # nothing of an older save is carried over


def _broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's value on every rank (a tensor broadcast: no pickled objects travel either)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


# ---------------------------------------------------------------------------------------------- loading
def load_sharded(module_or_native: NativeModel | nn.Module, directory: str | Path,
                 optimizer: torch.optim.Optimizer | None = None, verify_checksums: bool = True) -> dict:
    """Fill a NativeModel (any layout; collective over its mesh) or a plain module (no process group needed).

    optimizer: also restore its state and hyperparameters (the checkpoint must hold one). Returns the
    extra_json files {name: value} that the save wrote.
    """
    module = module_or_native.module if isinstance(module_or_native, NativeModel) else module_or_native
    if not isinstance(module, nn.Module):
        raise TypeError(f"module_or_native: expected a NativeModel or an nn.Module, got {type(module).__name__}")
    checked = check_sharded(directory, verify_checksums)
    directory, manifest = checked.directory, checked.manifest
    if optimizer is not None and not manifest["optimizer"]:
        raise ValueError(f"optimizer: {directory} was saved without an optimizer state")
    _check_names(module, checked.shapes[MODEL_DIR])
    _load_model(module, directory / MODEL_DIR)
    if optimizer is not None:
        _load_optimizer(module, optimizer, directory, set(checked.shapes[OPTIMIZER_DIR]))
    return {name: read_json_file(directory / name) for name in manifest["extra_json"]}


def _check_names(module: nn.Module, stored: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming the module's tensors that the checkpoint lacks or holds in another global shape.

    Names the checkpoint has and the module lacks are fine: a pipeline stage holds only its own layers.
    """
    expected = logical_shapes(module)  # DTensor: the global shape; placed expert stacks: [E, ...] as on disk
    missing = sorted(set(expected) - set(stored))
    mismatched = [f"{name}: checkpoint {list(stored[name])} vs module {list(shape)}"
                  for name, shape in expected.items() if name in stored and stored[name] != shape]
    if missing or mismatched:
        raise ValueError(f"checkpoint does not match the module: missing tensors {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; shape mismatches {mismatched[:8]}")


def _is_distributed(module: nn.Module) -> bool:
    return any(isinstance(t, DTensor) for t in module.state_dict().values())


def _read(state: dict[str, torch.Tensor], folder: Path, distributed: bool) -> None:
    """dcp.load into the tensors of `state`, in place. Not distributed: this process reads alone, with no
    collective, whether or not a process group exists (a plain module is not sharded)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # what no_dist=True means
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not distributed)


def _load_model(module: nn.Module, folder: Path) -> None:
    if _is_distributed(module):
        load_local_shards(module, folder)
        return
    state = module.state_dict()
    _read(state, folder, distributed=False)
    module.load_state_dict(state)


def _load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, stored: set[str]) -> None:
    """stored: the optimizer tensors' names in the checkpoint."""
    folder = directory / OPTIMIZER_DIR
    state = get_optimizer_state_dict(module, optimizer)  # allocates every parameter's state when there is none
    # a parameter that never had a gradient before the save has no state there: it must start fresh here too
    kept = {}
    for param, values in state["state"].items():
        present = [f"{param}.{key}" in stored for key in values]
        if all(present):
            kept[param] = values
        elif any(present):
            raise ValueError(f"optimizer: the checkpoint has only part of {param!r}'s state {sorted(values)}")
    state["state"] = kept
    flat = flatten_optimizer_state(kept)
    placed = placed_layers(module)
    logical = logical_targets(flat, placed, module.config.moe.num_experts)
    _read(flat | logical, folder, distributed=_is_distributed(module))
    copy_to_slots(flat, logical, placed)  # the flat entries are the state's own tensors: filled in place
    saved = read_json_file(directory / OPTIMIZER_JSON)
    if len(saved) != len(state["param_groups"]):
        raise ValueError(f"optimizer: {len(state['param_groups'])} param groups, the checkpoint has {len(saved)}")
    for group, hyper in zip(state["param_groups"], saved):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in hyper.items()})
    # strict=False: the parameters without state (dropped above) are expected, not an error
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(strict=False))


# ---------------------------------------------------------------------------------------------- export
def export_safetensors(directory: str | Path, out_dir: str | Path, max_shard_size: int | str = "2GB",
                       verify_checksums: bool = True) -> Path:
    """One process: a sharded checkpoint -> a save_pretrained directory (config.json + safetensors + checksums).

    Reads one output shard (at most max_shard_size bytes) at a time, so memory stays near that size;
    written atomically like save_pretrained, where check_output_dir allows. Returns out_dir.
    """
    out_dir = check_output_dir(out_dir, sources=(directory,), name="out_dir")
    directory = check_sharded(directory, verify_checksums).directory
    config = ModelConfig.from_json(directory / CONFIG_NAME)
    reader = HuggingFaceStorageReader(str(directory / MODEL_DIR))
    metadata = reader.read_metadata().state_dict_metadata
    skeleton = {name: torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
                for name, meta in metadata.items()}
    if config.tie_word_embeddings:
        skeleton.pop("lm_head.weight", None)  # stored once, as the embedding (see checkpoint_state_dict)
    shards = shard_state_dict(skeleton, parse_size(max_shard_size))
    with writing_temporary(out_dir) as tmp:
        (tmp / CONFIG_NAME).write_text(config.to_json())
        write_tokenizer_files(tmp, config.max_position_embeddings)
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, start=1):
            tensors = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in shard.items()}
            _read(tensors, directory / MODEL_DIR, distributed=False)
            file = WEIGHTS_NAME if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        write_checksums(tmp, [p.name for p in tmp.iterdir() if p.suffix == ".safetensors" or p.name == INDEX_NAME])
        swap_in(tmp, out_dir)
    return out_dir

