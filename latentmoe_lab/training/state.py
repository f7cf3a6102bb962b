"""Trainer state without pickle: tensors to safetensors, everything else to JSON (docs/design.md §9).

    trainer_state.safetensors   optimizer tensors "optimizer.<param index>.<key>" and "rng.torch"
    trainer.json                {"step", "optimizer": {"param_groups", "scalars"}, "scheduler", "history", ...}

Both files sit inside the checkpoint directory and are written in the same atomic step as the weights
(checkpoint.save_checkpoint), so a checkpoint and its trainer state can never come from different steps.
Loading checks every tensor before setting anything (check_tensors): a damaged file is a one-line ValueError
naming it and the tensor, not a failure at the first step. training/resume.py checks trainer.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

TENSORS_NAME = "trainer_state.safetensors"
JSON_NAME = "trainer.json"
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # what AdamW keeps per parameter (amsgrad off)


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split optimizer.state_dict() into ({name: tensor}, JSON-able rest)."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of optimizer_to_files: a state dict for optimizer.load_state_dict()."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def trainer_files(step: int, optimizer: torch.optim.Optimizer, scheduler, extra: dict[str, Any]):
    """(extra_tensors, extra_json) arguments of checkpoint.save_checkpoint for the trainer state at `step`."""
    tensors, optimizer_meta = optimizer_to_files(optimizer)
    tensors["rng.torch"] = torch.get_rng_state()
    body = {"step": step, "optimizer": optimizer_meta, "scheduler": scheduler.state_dict(), **extra}
    return {TENSORS_NAME: tensors}, {JSON_NAME: body}


def read_trainer_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """The trainer tensors of a checkpoint directory; a missing or unreadable file is a ValueError naming it."""
    path = Path(directory) / TENSORS_NAME
    if not path.is_file():
        raise ValueError(f"resume: {path} is missing; {directory} is not a checkpoint of a training run")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None


def restore(optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
            path: str | Path) -> None:
    """Load the optimizer and torch RNG state (trainer.json's `meta`, the tensors read from `path`).

    Everything is checked before anything is set: a bad file raises ValueError naming it and the tensor.
    """
    check_tensors(optimizer, tensors, path)
    try:
        optimizer.load_state_dict(optimizer_from_files(tensors, meta["optimizer"]))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{Path(path).parent / JSON_NAME}: optimizer: does not fit the optimizer "
                         f"({type(error).__name__}: {error})") from None
    torch.set_rng_state(tensors["rng.torch"])


def check_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """ValueError naming `path` and the tensor: an RNG state of another size or dtype, an unknown name, an
    AdamW state that lacks one of ADAM_KEYS, or a moment whose shape differs from its parameter's."""
    rng, expected = tensors.get("rng.torch"), torch.get_rng_state()
    if rng is None or rng.dtype != expected.dtype or rng.shape != expected.shape:
        found = "nothing" if rng is None else f"{rng.dtype} {list(rng.shape)}"
        raise ValueError(f"{path}: rng.torch must be torch's CPU generator state ({expected.dtype} "
                         f"{list(expected.shape)}), got {found}")
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".", 2)
        if name == "rng.torch":
            continue
        if len(parts) != 3 or parts[0] != "optimizer" or not parts[1].isdigit() or int(parts[1]) >= len(params) \
                or parts[2] not in ADAM_KEYS:
            raise ValueError(f"{path}: unexpected tensor {name!r} (expected optimizer.<index < {len(params)}>."
                             f"<{' | '.join(ADAM_KEYS)}> and rng.torch)")
        state.setdefault(int(parts[1]), {})[parts[2]] = tensor
    for index, entries in sorted(state.items()):
        missing = [key for key in ADAM_KEYS if key not in entries]
        if missing:
            raise ValueError(f"{path}: optimizer.{index} lacks {', '.join(missing)} (AdamW keeps "
                             f"{', '.join(ADAM_KEYS)} for every parameter that had a gradient)")
        if entries["step"].numel() != 1:
            raise ValueError(f"{path}: optimizer.{index}.step must hold one number, got shape "
                             f"{list(entries['step'].shape)}")
        shape = list(params[index].shape)
        for key in ADAM_KEYS[1:]:
            if list(entries[key].shape) != shape or not entries[key].is_floating_point():
                raise ValueError(f"{path}: optimizer.{index}.{key} is {entries[key].dtype} "
                                 f"{list(entries[key].shape)}, its parameter is {params[index].dtype} {shape}")
