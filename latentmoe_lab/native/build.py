"""Build this rank's share of the model on torch's engine, without ever holding the whole model.

    1. build LatentMoEForCausalLM on the meta device (no memory);
    2. pp > 1: keep this stage's blocks (PipelineStageModule);
    3. tp > 1: parallelize_module plans (tensor_plan.py); ep > 1: experts split (expert.py), in contiguous
       blocks or in the slots of an EPLB placement (native/eplb.py);
    4. FSDP2: fully_shard each block and the root over "data" (dp_shard x ep), the experts over
       dp_shard alone (they are already split over ep), with the layout's mixed-precision policy;
    5. to_empty: allocate the local shards only;
    6. fill them: from a save_pretrained directory through torch.distributed.checkpoint's
       HuggingFaceStorageReader, which reads each rank's slices out of the safetensors files,
       or with a fresh seeded initialisation of the local shards.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.kda import A_INIT_RANGE, DT_INIT_RANGE
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.expert import apply_expert_parallel
from latentmoe_lab.native.eplb import (check_native_placement, copy_to_slots, logical_targets,
                                                   placed_layers, to_logical)
from latentmoe_lab.native.layout import PARAM_DTYPES, NativeLayout
from latentmoe_lab.native.stage import PipelineStageModule, named_blocks
from latentmoe_lab.native.tensor_plan import apply_tensor_parallel
from latentmoe_lab.parallel.pipeline import partition_layers


@dataclass
class NativeModel:
    """One rank's module (the full model class, or a pipeline stage) and where it sits."""

    module: nn.Module
    layout: NativeLayout
    mesh: object
    stage_layers: list[range]  # per pp stage, its global layer indices
    dtype: torch.dtype = torch.float32  # of the stored (sharded) parameters
    device: torch.device = torch.device("cpu")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: FSDP2's param_dtype where FSDP2 runs (more than one data shard) and casts."""
        cast = PARAM_DTYPES[self.layout.param_dtype]
        return cast if cast is not None and self.layout.data_shards > 1 else self.dtype

    def reshard(self) -> None:
        """Free every FSDP2 unit's gathered parameters (the root keeps them after a forward)."""
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @property
    def is_first_stage(self) -> bool:
        return self.mesh["pp"].get_local_rank() == 0

    @property
    def is_last_stage(self) -> bool:
        return self.mesh["pp"].get_local_rank() == self.layout.pp - 1


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for _, block in named_blocks(module) if isinstance(block.ffn, LatentMoE)
            for p in block.ffn.experts.parameters()]


def apply_fsdp(module: nn.Module, mesh, layout: NativeLayout) -> None:
    """fully_shard blocks and root over "data"; experts over dp_shard (or left to the train step)."""
    cast = PARAM_DTYPES[layout.param_dtype]
    policy = MixedPrecisionPolicy(param_dtype=cast, reduce_dtype=torch.float32 if cast is not None else None)
    if layout.dp_shard > 1:
        for _, block in named_blocks(module):
            if isinstance(block.ffn, LatentMoE):
                # averaged over dp_shard here; the train step divides by ep (gloo has no PREMUL_SUM for
                # set_gradient_divide_factor, and the same division then serves the layouts without FSDP)
                fully_shard(block.ffn.experts, mesh=mesh["dp_shard"], mp_policy=policy)
    if layout.data_shards == 1:
        return
    # experts not sharded above (dp_shard == 1) stay out of the "data" units: they are split over ep already
    ignored = None if layout.dp_shard > 1 else set(expert_params(module)) or None
    for _, block in named_blocks(module):
        fully_shard(block, mesh=mesh["data"], mp_policy=policy, ignored_params=ignored)
    # the root unit (embeddings, final norm, head) is needed again right away in backward: keep it gathered
    fully_shard(module, mesh=mesh["data"], mp_policy=policy, reshard_after_forward=False, ignored_params=ignored)


def build_native(config: ModelConfig, layout: NativeLayout, mesh, checkpoint: str | Path | None = None,
                 seed: int = 0, dtype: torch.dtype = torch.float32, placement: torch.Tensor | None = None
                 ) -> NativeModel:
    """This rank's model under `layout` on `mesh` (layout.build_mesh), loaded from `checkpoint` or freshly seeded.

    dtype: of the stored parameters (fp32 masters; fp64 for the equivalence checks). placement: an EPLB
    placement [MoE layers, P] (phy2log of parallel/eplb/rebalance.py) for the experts (native/eplb.py; ep > 1).
    """
    layout.validate_for(config, mesh.size())
    if placement is not None:
        check_native_placement(placement, config, layout.ep)
    with torch.device("meta"):
        full = LatentMoEForCausalLM(config).to(dtype)
    stages = partition_layers(config, layout.pp, full)
    stage = mesh["pp"].get_local_rank()
    module = full if layout.pp == 1 else PipelineStageModule(full, stages[stage], stage == 0, stage == layout.pp - 1)
    if layout.tp > 1:
        apply_tensor_parallel(module, mesh["tp"])
    if layout.ep > 1:
        apply_expert_parallel(module, mesh["ep"], placement)
    apply_fsdp(module, mesh, layout)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else \
        torch.device(mesh.device_type)
    module.to_empty(device=device)
    if checkpoint is not None:
        load_local_shards(module, checkpoint)
    else:
        initialise_local_shards(module, seed)
        copy_first_replicas(module)  # each slot drew its own weights: a replica must be a copy
    return NativeModel(module, layout, mesh, stages, dtype, device)


def from_pretrained(path: str | Path, layout: NativeLayout, mesh=None, dtype: torch.dtype = torch.float32
                    ) -> NativeModel:
    """A save_pretrained directory (config.json + safetensors) as this rank's NativeModel; reads only its slices.

    mesh: the layout's NativeMesh (built here when None; every rank of the default group must call this).
    """
    from latentmoe_lab.checkpoint import CONFIG_NAME
    from latentmoe_lab.native.layout import build_mesh

    config = ModelConfig.from_json_file(Path(path) / CONFIG_NAME)
    return build_native(config, layout, mesh if mesh is not None else build_mesh(layout), checkpoint=path,
                        dtype=dtype)


@torch.no_grad()
def initialise_local_shards(module: nn.Module, seed: int) -> None:
    """A fresh start without a checkpoint: each rank draws its own local shards from `seed`.

    The layers' rules on local tensors: norms 1, biases 0, A_log = log U[1, 16], dt_bias = softplus^-1 of a
    log-uniform dt in [1e-3, 1e-1], everything else normal(0, initializer_range); routing biases 0. Not the
    single-process draw (that would need whole tensors): the equivalence checks start from a checkpoint.
    """
    std = module.config.initializer_range
    for name, param in module.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        # one stream per (parameter, shard): replicas of a tensor (over tp, or not sharded at all) draw alike
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}{_shard_coordinates(param)}"
                                                                                .encode()))
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            local.zero_()
        elif "norm" in name:
            local.fill_(1.0)
        elif leaf == "A_log":
            local.copy_(torch.empty(local.shape).uniform_(*A_INIT_RANGE, generator=generator).log())
        elif leaf == "dt_bias":
            low, high = (math.log(x) for x in DT_INIT_RANGE)
            dt = torch.empty(local.shape).uniform_(low, high, generator=generator).exp()
            local.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:
            local.copy_(torch.randn(local.shape, generator=generator) * std)
    for buffer in module.buffers():
        buffer.zero_()  # the routing correction biases


def _shard_coordinates(param: torch.Tensor) -> tuple[int, ...]:
    """This rank's index on each mesh dim that shards `param` (empty for a replicated or plain tensor)."""
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return tuple(mesh.get_local_rank(i) for i, placement in enumerate(param.placements) if placement.is_shard())


def copy_first_replicas(module: nn.Module) -> None:
    """Under a placement with replicas: every replica of an expert takes the weights of its first one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    placed = placed_layers(module)
    if not placed:
        return
    state = get_model_state_dict(module)
    copy_to_slots(state, to_logical(state, placed, module.config.moe.num_experts), placed)
    set_model_state_dict(module, state)


def load_local_shards(module: nn.Module, checkpoint: str | Path) -> None:
    """Fill the (allocated, empty) local shards from a save_pretrained directory, reading only their slices."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    options = StateDictOptions(strict=True)
    state = get_model_state_dict(module, options=options)
    # expert stacks in slot order are read as the logical stacks on disk, then moved into their slots
    placed = placed_layers(module)
    logical = logical_targets(state, placed, module.config.moe.num_experts)
    dcp.load(state | logical, storage_reader=HuggingFaceStorageReader(str(checkpoint)))
    copy_to_slots(state, logical, placed)
    set_model_state_dict(module, state, options=options)
