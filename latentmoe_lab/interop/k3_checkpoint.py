"""Read and write the K3 checkpoint format: config.json + sharded safetensors (docs/design.md §18).

    load_k3(model_class, path, dtype=None, experts="dequantize")   a K3 directory -> model_class(config), eval
    save_k3(model, path, experts="mxfp4", dtype=torch.bfloat16) our model -> a K3 directory

Names come from k3.name_table (logical layout), stored forms from k3_storage (A_log padded, MXFP4 experts, fp32
or bf16 per tensor). Every stored name, shape and dtype is checked against the config before any data is read,
and one ValueError names the first problem. vision_tower.* and mm_projector.* (K3's MoonViT tower and projector,
which this package does not model) are skipped; any other name the table does not give is refused.

Routed experts, when the file holds MXFP4 (text_config.quantization_config):
    experts="dequantize"   (default, and what from_pretrained does) decoded exactly into plain LatentExperts:
                           a plain model that save_pretrained, training and every other path take.
    experts="packed"       the bytes go untouched into quant.experts.QuantLatentExperts(fmt="mxfp4"), which
                           dequantizes in tiles in forward; the model carries quant_recipe "mxfp4-experts" (save
                           it with save_k3, byte for byte, or quant's save_quantized).
The writer shards like the release: the dense layers in one file, one file per MoE layer, then the embeddings,
final norms and LM head (the release's 96 = these 94 + MoonViT's two).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from latentmoe_lab.checkpoint_checks import CONFIG_NAME, INDEX_NAME, refuse_pickle, resolve_checkpoint_dir, weight_files
from latentmoe_lab.checkpoint_dir import check_output_dir, swap_in, writing_temporary
from latentmoe_lab.interop import k3
from latentmoe_lab.interop.detect import read_config_json
from latentmoe_lab.interop.export import check_round_trip
from latentmoe_lab.interop.mapped_files import MappedFiles
from latentmoe_lab.interop.k3_storage import (A_LOG_SUFFIX, a_log_stored_size, check_quantization_config,
                                              is_expert_weight, narrow_a_log, pack_matrix, packed_names,
                                              packed_shapes, pad_a_log, quantization_config, stored_dtype,
                                              unpack_matrix)
from latentmoe_lab.interop.names import TensorMapping, Unexpressible, their_views

SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
EXPERT_MODES = ("dequantize", "packed")


# ----------------------------------------------------------------------------------------------- specs
def stored_specs(table: list[TensorMapping], shapes: dict[str, tuple[int, ...]], quantized: bool
                 ) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """(stored name, stored shape, stored dtype, our name) of every tensor the files hold, in table order, from
    our tensors' shapes alone (a meta-device model gives them at full scale without memory)."""
    specs = []
    for entry in table:
        views = their_views(entry, torch.empty(shapes[entry.ours], device="meta"))
        for theirs, view in zip(entry.theirs, views):
            if quantized and is_expert_weight(theirs):
                packed, scale = packed_names(theirs)
                packed_shape, scale_shape = packed_shapes(*view.shape, name=theirs)
                specs += [(packed, packed_shape, torch.uint8, entry.ours),
                          (scale, scale_shape, torch.uint8, entry.ours)]
            elif theirs.endswith(A_LOG_SUFFIX):
                specs.append((theirs, (a_log_stored_size(view.shape[0]),), torch.float32, entry.ours))
            else:
                specs.append((theirs, tuple(view.shape), stored_dtype(theirs), entry.ours))
    return specs


def _check_files(specs, mapped: MappedFiles, directory: Path) -> None:
    expected = {name: (shape, dtype) for name, shape, dtype, _ in specs}
    missing = [name for name in expected if name not in mapped.stored]
    extra = sorted(name for name in mapped.stored if name not in expected and not name.startswith(SKIPPED_PREFIXES))
    mismatched = []
    for name in expected.keys() & mapped.stored.keys():
        shape, dtype = expected[name]
        got_shape, got_dtype = mapped.shape(name), mapped.dtype(name)
        if name.endswith(A_LOG_SUFFIX) and len(got_shape) == 1:
            pass  # any padded length: narrow_a_log checks the live values and the zero padding while loading
        elif got_shape != shape:
            mismatched.append(f"{name} has shape {list(got_shape)}, the config gives {list(shape)}")
        elif (got_dtype == torch.uint8) != (dtype == torch.uint8) or not (got_dtype.is_floating_point
                                                                           or got_dtype == torch.uint8):
            mismatched.append(f"{name} is {got_dtype}, expected {dtype}")
    for problems, what in ((missing, "missing tensor"), (extra, "unexpected tensor"), (sorted(mismatched), "")):
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            shown = f"{what} {problems[0]!r}" if what else problems[0]
            raise ValueError(f"checkpoint {directory}: {shown}{more}")


# ---------------------------------------------------------------------------------------------- load
def load_k3(model_class: type, path: str | Path, dtype: torch.dtype | None = None,
            experts: str = "dequantize") -> nn.Module:
    """model_class(config) holding the K3 checkpoint at `path`, in eval mode.

    dtype: the floating dtype of the dense parameters (default: torch's default); the router bias stays fp32.
    experts: "dequantize" or "packed" (module docstring); ignored when the file's experts are not MXFP4.
    """
    from accelerate import init_empty_weights

    if experts not in EXPERT_MODES:
        raise ValueError(f"experts: expected one of {EXPERT_MODES}, got {experts!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")
    directory = resolve_checkpoint_dir(path)
    hf = read_config_json(directory)
    config = k3.config_from_hf(hf)
    quantized = check_quantization_config(hf["text_config"].get("quantization_config"))
    refuse_pickle(directory)
    _, files, _ = weight_files(directory)
    with MappedFiles(files) as mapped:
        with init_empty_weights():
            model = model_class(config)
        model.tie_weights()
        table = k3.name_table(config)
        state = model.state_dict(keep_vars=True)
        specs = stored_specs(table, {name: tuple(t.shape) for name, t in state.items()}, quantized)
        _check_files(specs, mapped, directory)
        for entry in table:
            if quantized and experts == "packed" and is_expert_weight(entry.theirs[0]):
                continue  # both expert tensors of a layer are placed together below
            _load_entry(model, entry, state[entry.ours], mapped, dtype, config.kda.num_heads, quantized)
        if quantized and experts == "packed":
            from latentmoe_lab.quant.recipes import get_recipe

            for i in range(config.first_dense_layers, config.num_layers):
                _place_packed_experts(model, i, mapped)
            model.quant_recipe = get_recipe("mxfp4-experts")
    model.tie_weights()
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"{k3.MODEL_TYPE} name table leaves {left[0]} unloaded")
    return model.eval()


def _load_entry(model: nn.Module, entry: TensorMapping, current: torch.Tensor, mapped: MappedFiles,
                dtype: torch.dtype | None, num_heads: int, quantized: bool) -> None:
    module_name, _, leaf = entry.ours.rpartition(".")
    module = model.get_submodule(module_name)
    is_buffer = leaf in module._buffers
    want = current.dtype if is_buffer or not current.is_floating_point() or dtype is None else dtype
    value = torch.empty(current.shape, dtype=want)
    for theirs, view in zip(entry.theirs, their_views(entry, value)):
        if quantized and is_expert_weight(theirs):
            packed, scale = (mapped.read(name) for name in packed_names(theirs))
            view.copy_(unpack_matrix(packed, scale, theirs))
        elif theirs.endswith(A_LOG_SUFFIX):
            view.copy_(narrow_a_log(mapped.read(theirs), num_heads, theirs))
        else:
            mapped.read(theirs, out=view)
    if is_buffer:
        module._buffers[leaf] = value
    else:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)


def _place_packed_experts(model: nn.Module, layer: int, mapped: MappedFiles) -> None:
    """Layer `layer`'s routed experts from their MXFP4 bytes into a QuantLatentExperts (no decoding):
    w13 rows = w1 (gate) rows then w3 (up) rows, w2 rows = w2 rows, scales alike."""
    from latentmoe_lab.quant.experts import QuantLatentExperts

    moe = model.layers[layer].ffn
    plain = moe.experts
    num_experts, latent, two_inter = plain.w13.shape
    packed = QuantLatentExperts(num_experts, latent, two_inter // 2, "mxfp4", plain.activation_clamp, device="cpu",
                                situ_betas=plain.situ_betas)
    block = f"{k3.PREFIX}layers.{layer}.block_sparse_moe.experts."
    for e in range(num_experts):
        for buffer, matrices in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            pairs = [[mapped.read(name) for name in packed_names(f"{block}{e}.{m}.weight")] for m in matrices]
            getattr(packed, f"{buffer}_data")[e].copy_(torch.cat([data for data, _ in pairs]))
            getattr(packed, f"{buffer}_scale")[e].copy_(torch.cat([scale for _, scale in pairs]))
    moe.experts = packed


# ---------------------------------------------------------------------------------------------- save
def save_k3(model: nn.Module, path: str | Path, experts: str = "mxfp4", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `model` as a K3 directory at `path` (atomically, where checkpoint_dir.check_output_dir allows);
    returns the directory.

    experts: "mxfp4" (the release's format: packed experts are written byte for byte, plain ones quantized by
    quant/weight_mxfp4.py's rounding) or "plain" (`.weight` experts in `dtype`, no quantization_config).
    dtype: storage of the tensors the release keeps in bf16 (torch.float32 keeps fp32 weights exact); the
    release's fp32 tensors (k3_storage.FP32_SUFFIXES) stay fp32. What the format cannot say: Unexpressible,
    before anything is written (k3.config_to_hf, then export.check_round_trip for switches k3.py does not know).
    """
    if experts not in ("mxfp4", "plain"):
        raise ValueError(f"experts: expected 'mxfp4' or 'plain', got {experts!r}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype!r}")
    config = model.config
    hf = k3.config_to_hf(config)
    check_round_trip(config, k3.config_from_hf(hf), k3.MODEL_TYPE)
    if experts == "mxfp4":
        hf["text_config"]["quantization_config"] = quantization_config()
    path = check_output_dir(path)
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(_shard_count(config))]
    with torch.no_grad():
        for entry in k3.name_table(config):
            shard = _shard_of(entry.ours, config)
            for name, tensor in _stored_tensors(model, entry, experts == "mxfp4", dtype):
                tensors[shard][name] = tensor.cpu()
    with writing_temporary(path) as tmp:
        _write_shards(tmp, tensors)
        (tmp / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
        swap_in(tmp, path)
    return path


def _stored_tensors(model: nn.Module, entry: TensorMapping, mxfp4: bool, dtype: torch.dtype):
    """(stored name, tensor) pairs of one table entry."""
    module_name, _, leaf = entry.ours.rpartition(".")
    module = model.get_submodule(module_name)
    if hasattr(module, "w13_data"):  # QuantLatentExperts: the packed bytes themselves
        yield from _packed_expert_tensors(module, entry, leaf, mxfp4)
        return
    if hasattr(module, "weight_data"):  # a QuantLinear: packed data (its `weight` would be a dequantized copy)
        raise Unexpressible(f"{type(module).__name__} at {module_name}: the K3 format stores {entry.theirs[0]} "
                            f"unquantized; save a model whose only packed weights are MXFP4 routed experts")
    ours = getattr(module, leaf).detach()
    for theirs, view in zip(entry.theirs, their_views(entry, ours)):
        if is_expert_weight(theirs) and mxfp4:
            yield from zip(packed_names(theirs), pack_matrix(view, theirs))
        elif theirs.endswith(A_LOG_SUFFIX):
            yield theirs, pad_a_log(view)
        else:
            keep = stored_dtype(theirs) if stored_dtype(theirs) == torch.float32 else dtype
            yield theirs, view.to(keep).contiguous()


def _packed_expert_tensors(module: nn.Module, entry: TensorMapping, leaf: str, mxfp4: bool):
    if module.format.name != "mxfp4":
        raise Unexpressible(f"{module.format.name} experts ({entry.ours}): the K3 format holds MXFP4 experts")
    if not mxfp4:
        raise Unexpressible(f"packed MXFP4 experts ({entry.ours}) as experts='plain': save with experts='mxfp4'")
    data, scale = getattr(module, f"{leaf}_data"), getattr(module, f"{leaf}_scale")
    num_experts = data.shape[0]
    rows = data.shape[1] // 2 if leaf == "w13" else data.shape[1]
    for i, theirs in enumerate(entry.theirs):  # w13: E gate names then E up names; w2: E down names
        e, half = i % num_experts, i // num_experts
        packed_name, scale_name = packed_names(theirs)
        yield packed_name, data[e, half * rows:(half + 1) * rows].contiguous()
        yield scale_name, scale[e, half * rows:(half + 1) * rows].contiguous()


def _shard_count(config) -> int:
    """The dense layers in one shard, one per MoE layer, then the embeddings / final norms / LM head."""
    return (config.first_dense_layers > 0) + (config.num_layers - config.first_dense_layers) + 1


def _shard_of(ours: str, config) -> int:
    if not ours.startswith("layers."):
        return _shard_count(config) - 1
    layer = int(ours.split(".")[1])
    dense_shard = int(config.first_dense_layers > 0)
    return 0 if layer < config.first_dense_layers else dense_shard + layer - config.first_dense_layers


def _write_shards(directory: Path, tensors: list[dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    names = _shard_names(len(tensors))
    weight_map, total = {}, 0
    for name, shard in zip(names, tensors):
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        for tensor_name, tensor in shard.items():
            weight_map[tensor_name] = name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:06d}.safetensors" for i in range(count)]
