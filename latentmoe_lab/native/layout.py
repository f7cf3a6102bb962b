"""NativeLayout: the sizes of torch's DeviceMesh dims for the native path, and the mesh itself.

Dims, outermost to innermost (`NATIVE_DIMS`):

    pp        pipeline stages (torch.distributed.pipelining)
    dp_shard  FSDP2 shards: batch rows, parameters sharded (fully_shard)
    ep        expert parallel: experts split; for everything else one more batch shard
    tp        tensor parallel: attention heads and FFN widths (parallelize_module plans)

world size = pp * dp_shard * ep * tp. The mesh also gets one flattened dim, "data" = dp_shard x ep:
the ranks that hold different batch rows. Dense parameters are FSDP-sharded over "data"; experts,
already split over ep, only over dp_shard (torchtitan's arrangement, docs/design.md §11).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from latentmoe_lab.config import ModelConfig

NATIVE_DIMS = ("pp", "dp_shard", "ep", "tp")
PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: compute in the stored dtype


@dataclass(frozen=True)
class NativeLayout:
    """Mesh sizes plus the FSDP2 mixed-precision policy.

    param_dtype: what FSDP2 all-gathers and computes in: "fp32" (the stored dtype, no cast) or
    "bf16"; gradients are reduced in fp32 and the sharded master weights keep their dtype.
    micro_batches: pipeline micro-batches per step (pp > 1).
    """

    dp_shard: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    param_dtype: str = "fp32"
    micro_batches: int = 2
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        for name in NATIVE_DIMS + ("micro_batches",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype: must be one of {sorted(PARAM_DTYPES)}, got {self.param_dtype!r}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule: must be 'gpipe' or '1f1b', got {self.schedule!r}")

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in NATIVE_DIMS)

    @property
    def data_shards(self) -> int:
        """Ranks holding different batch rows (dp_shard x ep)."""
        return self.dp_shard * self.ep

    @property
    def name(self) -> str:
        parts = [f"{d.upper().replace('_SHARD', '')}{getattr(self, d)}" for d in NATIVE_DIMS if getattr(self, d) > 1]
        parts = [p.replace("DP", "FSDP") for p in parts]
        return "x".join(parts) or "1 process"

    def validate_for(self, config: ModelConfig, world_size: int | None = None) -> None:
        """Raise ValueError naming the dimension whose split does not divide the model."""
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"world size: the layout {self.name} needs {self.world_size} processes, got {world_size}")
        if config.moe.num_experts % self.ep:
            raise ValueError(f"ep: {self.ep} must divide moe.num_experts = {config.moe.num_experts}")
        if self.pp > 1 and config.attn_res_block_size is not None:
            raise ValueError("attn_res_block_size: the native pipeline stages pass one hidden tensor, not the Block "
                             "AttnRes stream; use pp = 1 here, or parallel/ (its stages carry the stream)")
        tp = self.tp
        checks = {"kda.num_heads": config.kda.num_heads, "mla.num_heads": config.mla.num_heads,
                  "dense_intermediate_size": config.dense_intermediate_size,
                  "shared experts' width": config.moe.num_shared_experts * config.moe.expert_intermediate_size}
        for what, size in checks.items():
            if tp > 1 and size % tp:
                raise ValueError(f"tp: {tp} must divide {what} = {size}")
        if config.num_layers < self.pp:
            raise ValueError(f"pp: {self.pp} stages need at least as many layers, got num_layers = {config.num_layers}")

    def validate_batch(self, rows: int) -> None:
        per_pipeline = self.data_shards * (self.micro_batches if self.pp > 1 else 1)
        if rows % per_pipeline:
            raise ValueError(f"batch: {rows} rows must split evenly over dp_shard x ep = {self.data_shards} data "
                             f"shards{' x micro_batches' if self.pp > 1 else ''} ({per_pipeline})")


class NativeMesh:
    """The DeviceMesh (pp, dp_shard, ep, tp) of the default process group; mesh[name] is a 1-D sub-mesh.

    "data" is the flattened (dp_shard, ep) sub-mesh, kept here as torch asks callers to do.
    """

    def __init__(self, layout: NativeLayout, device_type: str | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        device_type = self.device_type

        self.root = init_device_mesh(device_type, tuple(getattr(layout, d) for d in NATIVE_DIMS),
                                     mesh_dim_names=NATIVE_DIMS)
        self._dims = {name: self.root[name] for name in NATIVE_DIMS}
        self._dims["data"] = self.root["dp_shard", "ep"]._flatten("data")

    def __getitem__(self, name: str):
        return self._dims[name]

    def size(self) -> int:
        return self.root.size()

    def get_rank(self) -> int:
        return self.root.get_rank()


def build_mesh(layout: NativeLayout, device_type: str | None = None) -> NativeMesh:
    """The mesh on `device_type` (default: cuda when available, else cpu; gloo or NCCL is the default group's)."""
    return NativeMesh(layout, device_type)
