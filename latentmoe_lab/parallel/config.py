"""ParallelConfig: how many ways each dimension of the model is split, and the rules that make a split legal.

Dimensions, outermost to innermost on the device mesh (`MESH_DIMS`):

    pp  pipeline stages          contiguous blocks of layers per stage
    dp  data-parallel replicas   batch rows
    ep  expert parallel          experts; for attention an EP rank is one more batch shard
    cp  context parallel         the sequence of a prefill
    tp  tensor parallel          attention / KDA heads, expert and FFN intermediate width

world size = pp * dp * ep * cp * tp. tp is innermost so a TP group sits on one node (NVLink);
EP groups then stride across nodes. The batch is split over dp * ep shards, because between MoE
layers an EP rank runs attention on its own tokens (as in the write-ups' EP64 x TP8 x PP4 layout).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from latentmoe_lab.config import ModelConfig

MESH_DIMS = ("pp", "dp", "ep", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the five mesh dimensions plus runtime options.

    sequence_parallel: inside a TP group, norms and residuals hold 1/tp of the sequence; the
    TP all-reduce becomes a reduce-scatter + all-gather (same bytes, 1/tp activation memory).
    overlap: run the shared experts while the token all-to-all is in flight.
    """

    ep: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1
    schedule: str = "1f1b"
    overlap: bool = True
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in MESH_DIMS + ("micro_batches",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: must be one of {SCHEDULES}, got {self.schedule!r}")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 3600):
            raise ValueError(f"timeout_s: must be a number of seconds in (0, 3600], got {self.timeout_s!r}")

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in MESH_DIMS)

    @property
    def data_shards(self) -> int:
        """Batch shards: dp replicas times EP ranks (each EP rank attends over its own rows)."""
        return self.dp * self.ep

    def name(self) -> str:
        """'EP2xTP2' style; 'single' when nothing is split."""
        parts = [f"{d.upper()}{getattr(self, d)}" for d in ("ep", "tp", "pp", "dp", "cp") if getattr(self, d) > 1]
        return "x".join(parts) + ("+SP" if self.sequence_parallel else "") if parts else "single"

    @classmethod
    def from_layout(cls, layout: str, **options) -> "ParallelConfig":
        """Parse 'EP64xTP8xPP4' (any order, 'x', '*' or spaces between parts) into a ParallelConfig."""
        if not isinstance(layout, str) or not layout.strip():
            raise ValueError(f"layout: expected a string like 'EP64xTP8xPP4', got {layout!r}")
        sizes: dict[str, int] = {}
        for part in re.split(r"[x*\s×]+", layout.strip()):
            match = re.fullmatch(r"(EP|TP|PP|DP|CP)(\d+)", part, flags=re.IGNORECASE)
            if not match:
                raise ValueError(f"layout: cannot read part {part!r} of {layout!r}; use e.g. 'EP64xTP8xPP4'")
            dim = match.group(1).lower()
            if dim in sizes:
                raise ValueError(f"layout: dimension {dim.upper()} appears twice in {layout!r}")
            sizes[dim] = int(match.group(2))
        return cls(**sizes, **options)

    # ------------------------------------------------------------------ validation
    def validate_for(self, config: ModelConfig, world_size: int | None = None) -> None:
        """Raise ValueError naming the dimension and the model size it fails to divide."""
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"world_size: layout {self.name()} needs {self.world_size} processes "
                             f"(pp*dp*ep*cp*tp), got {world_size}")
        _divides("ep", self.ep, config.moe.num_experts, "moe.num_experts")
        _divides("tp", self.tp, config.kda.num_heads, "kda.num_heads")
        _divides("tp", self.tp, config.mla.num_heads, "mla.num_heads")
        _divides("tp", self.tp, config.moe.expert_intermediate_size, "moe.expert_intermediate_size")
        if config.first_dense_layers:
            _divides("tp", self.tp, config.dense_intermediate_size, "dense_intermediate_size")
        if self.pp > config.num_layers:
            raise ValueError(f"pp: {self.pp} stages need at least one layer each, "
                             f"but num_layers is {config.num_layers}")

    def validate_batch(self, batch: int, seq_len: int) -> None:
        """Runtime shape rules: rows split over dp*ep shards, the prefill over cp (and tp with SP)."""
        if batch % self.data_shards:
            raise ValueError(f"input_ids: batch {batch} must be divisible by dp*ep = {self.data_shards}")
        if batch // self.data_shards % self.micro_batches:
            raise ValueError(f"micro_batches: {self.micro_batches} must divide the per-shard batch "
                             f"{batch // self.data_shards}")
        if seq_len % self.cp:
            raise ValueError(f"input_ids: sequence length {seq_len} must be divisible by cp = {self.cp}")
        if self.sequence_parallel and (seq_len // self.cp) % self.tp:
            raise ValueError(f"input_ids: with sequence_parallel the per-rank sequence {seq_len // self.cp} "
                             f"must be divisible by tp = {self.tp}")


def _divides(dim: str, size: int, total: int, what: str) -> None:
    if total % size:
        raise ValueError(f"{dim}: {size} must divide {what} ({total})")
