"""Load a transformers checkpoint directory (kimi_linear, deepseek_v32) into our model class (docs/design.md §17).

    config.json  -> detect.architecture(model_type).config_from_hf -> ModelConfig
    the model    -> built on the meta device (no memory), so a bad checkpoint costs nothing
    the names    -> the architecture's name_table against the files' headers: every missing tensor, extra tensor
                    and shape mismatch is found before any data is read, and reported in one line
    the data     -> each tensor copied once out of the memory-mapped files (mapped_files.py), cast to the target
                    dtype on the way, straight into its parameter

Nothing is returned unless every parameter was loaded; on any error the half-built model is dropped.
The model class is passed in (interop sits above model and never imports it).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from latentmoe_lab.checkpoint_checks import refuse_pickle, resolve_checkpoint_dir, weight_files
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.interop.detect import architecture, format_loader, read_config_json
from latentmoe_lab.interop.mapped_files import MappedFiles
from latentmoe_lab.interop.names import TensorMapping, their_shapes, their_views


def config_from_dir(path: str | Path) -> tuple[ModelConfig, object]:
    """(ModelConfig, architecture module) of a transformers checkpoint directory, from its config.json alone."""
    hf = read_config_json(resolve_checkpoint_dir(path))
    arch = architecture(hf.get("model_type"))
    return arch.config_from_hf(hf), arch


def load_transformers(model_class: type, path: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """model_class(config) holding the weights of the transformers checkpoint at `path`, in eval mode.

    dtype: the floating dtype of the parameters (default: torch's default dtype, as for our own checkpoints);
    the router's correction bias stays fp32. Raises a one-line ValueError naming the tensor or config key.
    """
    directory = resolve_checkpoint_dir(path)
    config, arch = config_from_dir(directory)
    own_loader = format_loader(arch.MODEL_TYPE)
    if own_loader is not None:  # K3: padded A_log, MXFP4 experts (interop/k3_checkpoint.py)
        return own_loader(model_class, directory, dtype=dtype)
    model, (mapped, _, _) = load_mapped(model_class, directory, dtype)
    mapped.close()
    return model


def load_mapped(model_class: type, path: str | Path, dtype: torch.dtype | None = None, keep_on_disk=None
                ) -> tuple[nn.Module, tuple[MappedFiles, dict[str, str], list[TensorMapping]]]:
    """(model, (the open mapped files, {canonical name: file name}, the name table)): load_transformers' work,
    with the files left open for the caller to close. keep_on_disk(our name) -> True leaves that tensor on the
    meta device, checked but not read (offload.py reads routed experts from the files when they are used)."""
    from accelerate import init_empty_weights

    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")
    directory = resolve_checkpoint_dir(path)
    config, arch = config_from_dir(directory)
    refuse_pickle(directory)
    _, files, _ = weight_files(directory)
    mapped = MappedFiles(files)
    try:
        names = canonical_names(list(mapped.stored), getattr(arch, "LEGACY_NAMES", []), directory)
        with init_empty_weights():
            model = model_class(config)
        model.tie_weights()
        table = arch.name_table(config)
        targets = _targets(model, table)
        check_against_files(table, targets, mapped, names, directory)
        for entry in table:
            if keep_on_disk is None or not keep_on_disk(entry.ours):
                _load_entry(model, entry, targets[entry.ours], mapped, names, dtype)
        model.tie_weights()
        left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
                if tensor.is_meta and (keep_on_disk is None or not keep_on_disk(name))]
        if left:  # a name table that misses one of our tensors: a bug in the architecture module, not the file
            raise RuntimeError(f"{arch.MODEL_TYPE} name table leaves {left[0]} unloaded")
    except BaseException:
        mapped.close()
        raise
    return model.eval(), (mapped, names, table)


def canonical_names(stored: list[str], legacy: list[tuple[str, str]], directory: Path) -> dict[str, str]:
    """{canonical name: name in the file}: each legacy substring replaced by its canonical form."""
    names: dict[str, str] = {}
    for name in stored:
        canonical = name
        for old, new in legacy:
            canonical = canonical.replace(old, new)
        if canonical in names:
            raise ValueError(f"checkpoint {directory}: tensors {names[canonical]!r} and {name!r} are the same "
                             f"tensor under two names")
        names[canonical] = name
    return names


def check_against_files(table: list[TensorMapping], targets: dict[str, tuple[tuple[int, ...], torch.dtype]],
                        mapped: MappedFiles, names: dict[str, str], directory: Path) -> None:
    """One ValueError naming the first missing tensor, extra tensor, shape or dtype mismatch (with a count)."""
    missing, mismatched, wrong_dtype, expected = [], [], [], set()
    for entry in table:
        shape, dtype = targets[entry.ours]
        for theirs, their_shape in zip(entry.theirs, their_shapes(entry, shape)):
            expected.add(theirs)
            if theirs not in names:
                missing.append(theirs)
                continue
            stored = mapped.shape(names[theirs])
            if stored != their_shape:
                mismatched.append(f"{theirs} has shape {list(stored)}, the config gives {list(their_shape)}")
            stored_dtype = mapped.dtype(names[theirs])
            if stored_dtype != dtype and not (stored_dtype.is_floating_point and dtype.is_floating_point):
                wrong_dtype.append(f"{theirs} is {stored_dtype}, expected {dtype}")
    extra = sorted(set(names) - expected)
    for problems, what in ((missing, "missing tensor"), (extra, "unexpected tensor"),
                           (mismatched, "shape mismatch:"), (wrong_dtype, "dtype mismatch:")):
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            first = problems[0] if what.endswith(":") else repr(names.get(problems[0], problems[0]))
            raise ValueError(f"checkpoint {directory}: {what} {first}{more}")


def _targets(model: nn.Module, table: list[TensorMapping]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{our name: (shape, dtype)} for each table entry; the table must cover our state dict exactly once."""
    state = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    ours = [entry.ours for entry in table]
    unknown = sorted(set(ours) - set(state))
    uncovered = sorted(set(state) - set(ours))
    if unknown or uncovered or len(ours) != len(set(ours)):
        raise RuntimeError(f"name table does not match the model: unknown {unknown[:3]}, uncovered {uncovered[:3]}")
    return {name: (tuple(state[name].shape), state[name].dtype) for name in ours}


def _load_entry(model: nn.Module, entry: TensorMapping, target: tuple[tuple[int, ...], torch.dtype],
                mapped: MappedFiles, names: dict[str, str], dtype: torch.dtype | None) -> None:
    """Allocate our tensor, copy each stored tensor into its view of it (names.their_views), and put it in
    place of the meta tensor: one copy per tensor, cast on the way, no intermediate."""
    shape, current = target
    module_name, _, leaf = entry.ours.rpartition(".")
    module = model.get_submodule(module_name)
    is_buffer = leaf in module._buffers
    # buffers (the router's correction bias) keep their dtype; parameters take `dtype` or the built one
    want = current if is_buffer or not current.is_floating_point or dtype is None else dtype
    value = torch.empty(shape, dtype=want)
    for theirs, view in zip(entry.theirs, their_views(entry, value)):
        mapped.read(names[theirs], out=view)
    if is_buffer:
        module._buffers[leaf] = value
    else:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)
