"""Write our model as a transformers checkpoint directory (docs/design.md §17).

    DIR/config.json                        the architecture's config_to_hf(config)
    DIR/model.safetensors                  their tensors, when they fit in max_shard_size ...
    DIR/model-0000k-of-0000n.safetensors   ... else shards, with
    DIR/model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map": {name: shard}}
    DIR/tokenizer.json, ...                the byte tokenizer's files, unless the source directory had its own

What the target cannot say is refused before anything is written, in one line naming the feature: first the
architecture's own checks (config_to_hf), then a generic one: reading the written config back
(config_from_hf) must give our config again on every field that changes the weights or the computation, so a
switch the architecture module does not know yet is refused by name instead of silently dropped.
The directory is written the way save_pretrained writes ours: atomically, where check_output_dir allows.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from latentmoe_lab.checkpoint import parse_size
from latentmoe_lab.checkpoint_checks import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from latentmoe_lab.checkpoint_dir import check_output_dir, swap_in, writing_temporary
from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.interop.detect import architecture, format_writer
from latentmoe_lab.interop.names import Unexpressible, their_views
from latentmoe_lab.tokenizer_files import write_tokenizer_files

# Fields that change neither the weights nor inference: training coefficients and rules, chunking and names.
IGNORED_ON_EXPORT = {"name", "initializer_range", "dsa_interval", "final_layer_dsa", "kda.chunk_size",
                     "moe.bias_update_rate", "moe.aux_loss_alpha", "moe.z_loss_coef", "moe.bias_update"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_transformers(model: nn.Module, path: str | Path, model_type: str, max_shard_size: int | str = "2GB",
                        tokenizer_from: str | Path | None = None) -> Path:
    """Write `model` (ours) as a `model_type` transformers checkpoint at `path`; returns the directory.

    tokenizer_from: a directory whose tokenizer files are copied (default: the byte tokenizer's are written).
    """
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"model: expected our model with a ModelConfig at .config, got {type(config).__name__}")
    arch = architecture(model_type)
    own_writer = format_writer(model_type)
    if own_writer is not None:  # K3: padded A_log, MXFP4 experts (interop/k3_checkpoint.py)
        return own_writer(model, path)
    hf = arch.config_to_hf(config)
    check_round_trip(config, arch.config_from_hf(hf), model_type)
    path = check_output_dir(path, sources=[tokenizer_from])
    limit = parse_size(max_shard_size)
    state = model.state_dict()
    with torch.no_grad(), writing_temporary(path) as tmp:
        _write_tokenizer(tmp, config, tokenizer_from)
        (tmp / CONFIG_NAME).write_text(json.dumps(hf, indent=2))
        _write_shards(tmp, arch.name_table(config), state, limit)
        swap_in(tmp, path)
    return path


def check_round_trip(config: ModelConfig, back: ModelConfig, model_type: str) -> None:
    """Unexpressible naming the first field (that matters, see module docstring) where `back` differs."""
    ours, theirs = _flat(config.to_dict()), _flat(back.to_dict())
    for key in ours:
        if _ignored(key, config):
            continue
        if ours[key] != theirs.get(key):
            raise Unexpressible(f"{model_type} cannot express {key}={ours[key]!r} (it reads back as "
                                f"{theirs.get(key)!r})")


def their_tensors(model: nn.Module, model_type: str) -> dict[str, torch.Tensor]:
    """{their name: tensor} of our model in `model_type`'s layout, all in memory (for small models and tests)."""
    arch = architecture(model_type)
    state = model.state_dict()
    out = {}
    for entry in arch.name_table(model.config):
        for name, view in zip(entry.theirs, their_views(entry, state[entry.ours].detach())):
            out[name] = view.contiguous()
    return out


def _write_shards(tmp: Path, table, state: dict[str, torch.Tensor], limit: int) -> None:
    """Their tensors in shards of at most `limit` bytes (a bigger tensor gets its own); one shard = one file.

    Only one shard's tensors are held at a time (each a contiguous copy of a view of ours).
    """
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for entry in table:
        for name, view in zip(entry.theirs, their_views(entry, state[entry.ours].detach())):
            size = view.numel() * view.element_size()
            if shards[-1] and used + size > limit:
                shards.append([])
                used = 0
            shards[-1].append((name, view))
            used += size
    if len(shards) == 1:
        save_file({name: view.cpu().contiguous() for name, view in shards[0]}, str(tmp / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: view.cpu().contiguous() for name, view in shard}, str(tmp / file), metadata={"format": "pt"})
        for name, view in shard:
            weight_map[name] = file
            total += view.numel() * view.element_size()
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2))


def _write_tokenizer(tmp: Path, config: ModelConfig, source: str | Path | None) -> None:
    if source is not None and (Path(source) / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, tmp / name)
        return
    write_tokenizer_files(tmp, config.max_position_embeddings)


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _ignored(key: str, config: ModelConfig) -> bool:
    """Fields that do not matter for this config: IGNORED_ON_EXPORT, and the parts of mechanisms it does not use."""
    part = key.split(".")[0]
    unused = {"kda": KDA not in config.layer_types, "mla": DSA not in config.layer_types,
              "indexer": DSA not in config.layer_types or not config.dsa.use_indexer,
              "dsa": DSA not in config.layer_types,
              "moe": config.first_dense_layers >= config.num_layers}
    if key == "dsa.index_share_every" and not config.dsa.use_indexer:
        return True
    if key == "dense_intermediate_size" and config.first_dense_layers == 0:
        return True
    if key == "moe.latent_size" and not config.moe.latent_projection:
        return True
    if key == "kda.gate_lower_bound" and config.kda.gate_form != "lower_bound":
        return True
    rope = config.mla.rope
    if (key == "mla.rope_theta" and rope == "none") or (key.startswith("mla.yarn_") and rope != "yarn"):
        return True
    return key in IGNORED_ON_EXPORT or unused.get(part, False)

