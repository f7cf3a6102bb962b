"""The device mesh: rank <-> coordinates, and one torch.distributed group per line of the mesh.

rank = (((pp * DP + dp) * EP + ep) * CP + cp) * TP + tp       (MESH_DIMS order, tp fastest)

The coordinate functions are pure (the planner and the figures use them without processes).
`ProcessMesh` creates, on every rank and in the same order, one subgroup per line along each
dimension of size > 1, each with the layout's timeout, so a dead peer surfaces as an error in
`timeout_s` at worst. gloo on CPU and NCCL on GPUs go through the same calls.
"""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from latentmoe_lab.parallel.config import MESH_DIMS, ParallelConfig


def rank_coords(pconfig: ParallelConfig, rank: int) -> dict[str, int]:
    """Global rank -> {"pp", "dp", "ep", "cp", "tp"} coordinates."""
    if not 0 <= rank < pconfig.world_size:
        raise ValueError(f"rank: must lie in [0, {pconfig.world_size}), got {rank}")
    coords = {}
    for dim in reversed(MESH_DIMS):
        size = getattr(pconfig, dim)
        coords[dim] = rank % size
        rank //= size
    return {d: coords[d] for d in MESH_DIMS}


def coords_rank(pconfig: ParallelConfig, coords: dict[str, int]) -> int:
    rank = 0
    for dim in MESH_DIMS:
        rank = rank * getattr(pconfig, dim) + coords.get(dim, 0)
    return rank


def line_members(pconfig: ParallelConfig, dim: str, rank: int) -> list[int]:
    """The ranks that share every coordinate of `rank` except `dim`, ordered by their `dim` index."""
    coords = rank_coords(pconfig, rank)
    return [coords_rank(pconfig, {**coords, dim: i}) for i in range(getattr(pconfig, dim))]


def all_lines(pconfig: ParallelConfig, dim: str) -> list[list[int]]:
    """Every line along `dim`, in a fixed order (the order in which groups must be created)."""
    others = [d for d in MESH_DIMS if d != dim]
    lines = []
    for values in itertools.product(*(range(getattr(pconfig, d)) for d in others)):
        lines.append(line_members(pconfig, dim, coords_rank(pconfig, dict(zip(others, values)))))
    return lines


def data_shard(pconfig: ParallelConfig, rank: int) -> int:
    """Which of the dp * ep batch shards this rank attends over (dp outer, ep inner)."""
    coords = rank_coords(pconfig, rank)
    return coords["dp"] * pconfig.ep + coords["ep"]


class ProcessMesh:
    """This process's place on the mesh, with a process group per dimension of size > 1."""

    def __init__(self, pconfig: ParallelConfig, device: torch.device | str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("ProcessMesh: torch.distributed is not initialized; call init_distributed() first")
        world = dist.get_world_size()
        if world != pconfig.world_size:
            raise ValueError(f"world_size: layout {pconfig.name()} needs {pconfig.world_size} processes, "
                             f"this run has {world}")
        self.pconfig = pconfig
        self.rank = dist.get_rank()
        self.device = torch.device(device)
        self.coords = rank_coords(pconfig, self.rank)
        self.members: dict[str, list[int]] = {d: line_members(pconfig, d, self.rank) for d in MESH_DIMS}
        self._groups: dict[str, dist.ProcessGroup] = {}
        timeout = timedelta(seconds=pconfig.timeout_s)
        for dim in MESH_DIMS:
            if getattr(pconfig, dim) == 1:
                continue
            for line in all_lines(pconfig, dim):  # collective: every rank creates every line's group
                group = dist.new_group(line, timeout=timeout)
                if self.rank in line:
                    self._groups[dim] = group

    def size(self, dim: str) -> int:
        return getattr(self.pconfig, dim)

    def index(self, dim: str) -> int:
        return self.coords[dim]

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The group of this rank's line along `dim`; None when the dimension has size 1."""
        return self._groups.get(dim)

    def peer(self, dim: str, index: int) -> int:
        """Global rank of the member with position `index` along `dim` (everything else equal)."""
        return self.members[dim][index]

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.pconfig.pp - 1


def init_distributed(timeout_s: float = 30.0):
    """Join the process group the launcher prepared (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the env).

    Goes through accelerate's PartialState: cpu=True (gloo) without CUDA, NCCL with it; the
    default group gets `timeout_s`. Returns (state, device).
    """
    from accelerate import PartialState

    use_cpu = not torch.cuda.is_available()
    state = PartialState(cpu=use_cpu, timeout=timedelta(seconds=timeout_s))
    device = torch.device("cpu") if use_cpu else state.device
    return state, device


def world_layout(pconfig: ParallelConfig) -> list[dict[str, int]]:
    """rank_coords for every rank (figures and tables)."""
    return [rank_coords(pconfig, r) for r in range(pconfig.world_size)]
