"""The host tier's counters for Engine.stats() (memory.offload, docs/design.md §15.1), wherever the pools live.

    offload_rows_moved / offload_bytes_moved        host -> hot buffer swaps (a selected row that was not hot)
    offload_rows_hit                                selected rows served from the hot buffer, not moved
    offload_host_read_rows / offload_host_read_bytes   rows prefill chunks read straight from the host tier

Summed over the whole model's DSA layers. In the engine's process they come from its OffloadedPools; with
worker processes each rank sends its own with every step (parallel_worker.py) and the first rank of each
pipeline stage counts for the stage (the other tensor / expert-parallel ranks of a stage hold replicated
rows and move the same ones). A restarted worker group counts from 0 again, as its pools are new.
"""
from __future__ import annotations

from latentmoe_lab.offload_tier import OffloadedPools
from latentmoe_lab.parallel.mesh import coords_rank


KEYS = ("rows_moved", "bytes_moved", "rows_hit", "host_read_rows", "host_read_bytes")  # OffloadedPools.stats()


def offload_stats(service, pools, runner) -> dict[str, int]:
    """{"offload_*": int} of an engine's pools (in its process) or its runner's ranks (zeros before their
    first step); {} without memory.offload."""
    if service.memory.offload is None:
        return {}
    if isinstance(pools, OffloadedPools):
        return _prefixed([pools.stats()])
    per_rank, pconfig = runner.rank_offload, runner.pconfig
    stages = [per_rank[coords_rank(pconfig, {"pp": stage})] for stage in range(pconfig.pp)]
    return _prefixed([stats for stats in stages if stats is not None])


def _prefixed(parts: list[dict[str, int]]) -> dict[str, int]:
    return {f"offload_{key}": sum(part[key] for part in parts) for key in KEYS}
