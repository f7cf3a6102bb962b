"""Where every parameter of a native layout lives, and what its gradient looks like after one backward.

    rows = parameter_placements(NativeLayout(tp=2))        # 2 local processes; rank 0's view
    rows["layers.1.attn.q_proj.weight"]
    # PlacementRow(placements='(Shard(dim=0),)', mesh_dims=('tp',), global_shape=(32, 64),
    #              local_shape=(16, 64), grad_placements='(Shard(dim=0),)')
    rows["layers.1.attn.o_norm.weight"].grad_placements    # '(Partial(sum),)': summed over tp when used

Read by notebook 04 §8 (docs/design.md §11). Each rank builds its share the way build_native does
for training (meta device, TP / EP plans, FSDP2, local shards) from a seeded start, then runs one
forward and backward on a small batch: placements and shapes do not depend on the values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from latentmoe_lab.native.layout import NativeLayout

NOT_A_DTENSOR = "-"  # a plain tensor: the same whole copy on every rank, outside any plan


@dataclass(frozen=True)
class PlacementRow:
    """One parameter on one rank; shapes as tuples of ints, placements as torch prints them."""

    placements: str
    mesh_dims: tuple[str, ...]
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    grad_placements: str  # of param.grad after one backward (before any optimizer step)


def _placements(tensor: torch.Tensor | None) -> str:
    if tensor is None:
        return "no gradient"
    return str(tensor.placements) if isinstance(tensor, DTensor) else NOT_A_DTENSOR


def placement_worker(layout: NativeLayout, preset: str, timeout_s: float) -> dict[str, list]:
    """Per rank: {name: [placements, mesh dim names, global shape, local shape, grad placements]}.

    Plain strings and lists only: launch reads results back with weights_only=True.
    """
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import local_rows
    from latentmoe_lab.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_s / 2)
    config = ModelConfig.from_preset(preset)
    native = build_native(config, layout, build_mesh(layout))
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (2 * layout.data_shards, 16), generator=generator)
    ids = local_rows(native, batch)
    output = native.module(ids, labels=ids)
    (output.loss + output.aux_loss).backward()
    table = {}
    for name, param in native.module.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        dims = list(param.device_mesh.mesh_dim_names) if isinstance(param, DTensor) else []
        table[name] = [_placements(param), dims, list(param.shape), list(local.shape), _placements(param.grad)]
    return table


def parameter_placements(layout: NativeLayout, preset: str = "tiny", rank: int = 0,
                         timeout_s: float = 120.0) -> dict[str, PlacementRow]:
    """Launch layout.world_size local processes (gloo) and return rank `rank`'s table, in parameter order."""
    from latentmoe_lab.parallel.launch import launch

    if layout.world_size < 2:
        raise ValueError(f"layout: placements need at least 2 processes, got the layout {layout.name}")
    if layout.pp > 1:
        raise ValueError(f"layout: placements are read without a pipeline schedule, got pp = {layout.pp}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank: must be an integer in [0, {layout.world_size}), got {rank!r}")
    results = launch(placement_worker, layout.world_size, args=(layout, preset, timeout_s), timeout_s=timeout_s)
    return {name: PlacementRow(p, tuple(dims), tuple(g), tuple(loc), grad)
            for name, (p, dims, g, loc, grad) in results[rank].items()}
