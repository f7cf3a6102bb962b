"""Where every parameter of a native layout lives: its DTensor placements, mesh dims, global and local shape.

    rows = parameter_placements(NativeLayout(dp_shard=2, tp=2))   # 4 local processes, rank 0's view
    rows["layers.1.attn.q_proj.weight"]
    # PlacementRow(placements='(_StridedShard(...), Shard(dim=0))', mesh_dims=('data', 'tp'), ...)

Read by notebook 04 §8 (docs/design.md §11). The model is built the way build_native builds it
for training (meta device, plans, FSDP2, local shards), from a seeded start: placements and shapes
do not depend on the values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from latentmoe_lab.native.layout import NativeLayout


@dataclass(frozen=True)
class PlacementRow:
    """One parameter on one rank. A plain tensor (no DTensor) shows placements "-" and no mesh dims."""

    placements: str
    mesh_dims: tuple[str, ...]
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]


def placement_worker(layout: NativeLayout, preset: str, timeout_s: float) -> dict[str, list]:
    """On each rank: {name: [placements, mesh dim names, global shape, local shape]} (plain types only:
    launch reads results back with weights_only=True)."""
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import local_rows
    from latentmoe_lab.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_s / 2)
    config = ModelConfig.from_preset(preset)
    native = build_native(config, layout, build_mesh(layout))
    batch = torch.randint(0, config.vocab_size, (layout.data_shards, 16), generator=torch.Generator().manual_seed(0))
    output = native.module(local_rows(native, batch), labels=local_rows(native, batch))
    (output.loss + output.aux_loss).backward()
    rows = {}
    for name, param in native.module.named_parameters():
        grad = "-" if param.grad is None else str(param.grad.placements) if isinstance(param.grad, DTensor) else "tensor"
        if isinstance(param, DTensor):
            rows[name] = [str(param.placements), list(param.device_mesh.mesh_dim_names),
                          list(param.shape), list(param.to_local().shape), grad]
        else:
            rows[name] = ["-", [], list(param.shape), list(param.shape), grad]
    return rows


def parameter_placements(layout: NativeLayout, preset: str = "tiny", rank: int = 0,
                         timeout_s: float = 120.0) -> dict[str, PlacementRow]:
    """Launch layout.world_size local processes and return rank `rank`'s table of placements."""
    from latentmoe_lab.parallel.launch import launch

    if layout.world_size < 2:
        raise ValueError(f"layout: placements need at least 2 processes, got the layout {layout.name}")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank: must be in [0, {layout.world_size}), got {rank}")
    results = launch(placement_worker, layout.world_size, args=(layout, preset, timeout_s), timeout_s=timeout_s)
    return {name: PlacementRow(p, tuple(dims), tuple(g), tuple(loc)) for name, (p, dims, g, loc) in results[rank].items()}
