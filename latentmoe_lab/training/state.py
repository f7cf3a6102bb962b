"""Trainer state without pickle: tensors to safetensors, everything else to JSON (docs/design.md §9).

    trainer_state.safetensors   optimizer tensors "optimizer.<param index>.<key>" and "rng.torch"
    trainer.json                {"step", "optimizer": {"param_groups", "scalars"}, "scheduler", "history", ...}

Both files sit inside the checkpoint directory and are written in the same atomic step as the weights
(checkpoint.save_checkpoint), so a checkpoint and its trainer state can never come from different steps.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

TENSORS_NAME = "trainer_state.safetensors"
JSON_NAME = "trainer.json"


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


def read_trainer_files(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(trainer.json contents, trainer tensors) of a checkpoint directory."""
    directory = Path(directory)
    if not (directory / JSON_NAME).exists() or not (directory / TENSORS_NAME).exists():
        raise ValueError(f"resume: {directory} has no {JSON_NAME} / {TENSORS_NAME}; it is not a training checkpoint")
    return json.loads((directory / JSON_NAME).read_text()), load_file(str(directory / TENSORS_NAME))


def restore(optimizer: torch.optim.Optimizer, scheduler, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Load optimizer, scheduler and torch RNG state read by read_trainer_files."""
    optimizer.load_state_dict(optimizer_from_files(tensors, meta["optimizer"]))
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
