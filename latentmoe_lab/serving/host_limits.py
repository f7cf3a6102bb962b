"""What this host can give a service: available memory and usable cores (docs/design.md §6.1).

Two uses:
    check_fits_host       a service file's sizes that `serve` would die on are refused when the file is
                          loaded, naming the key: memory.cache_bytes past the available memory (every
                          rank of a parallel layout holds its own pools), parallel.forward_threads past
                          the cores this process may run on
    default_cache_bytes   memory.cache_bytes left out on a CPU: CPU_CACHE_SHARE of the available memory,
                          at most CPU_CACHE_MAX_BYTES, split over the ranks. A fixed share with a cap, in
                          the spirit of the KV-space setting of public CPU serving backends: the caches
                          are one consumer of host memory among the weights, activations and the OS.

"Available" is the kernel's MemAvailable (memory that can be had without swapping; elsewhere the free
physical pages), lowered to the room left under this process's memory cgroup limit when it has one.
"""
from __future__ import annotations

import os
from pathlib import Path

from latentmoe_lab.meta import format_bytes
from latentmoe_lab.threads import check_within_cores

CPU_CACHE_SHARE = 0.10
CPU_CACHE_MAX_BYTES = 4 << 30


def available_memory_bytes() -> int | None:
    """Bytes of memory this process can still allocate without swapping; None when unknown."""
    available = _meminfo_available()
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None
    limit = _cgroup_room()
    return available if limit is None else min(available, limit)


def ranks_on_host(service) -> int:
    """Processes that each allocate memory.cache_bytes of pools: every rank of the parallel layout."""
    par = service.parallel
    return par.tensor_parallel_size * par.expert_parallel_size * par.pipeline_parallel_size


def check_fits_host(service) -> None:
    """ValueError naming the key when the service's sizes exceed this host (see the module docstring)."""
    cache_bytes = service.memory.cache_bytes
    if cache_bytes is not None:
        available, ranks = available_memory_bytes(), ranks_on_host(service)
        if available is not None and cache_bytes * ranks > available:
            each = f" on each of {ranks} ranks" if ranks > 1 else ""
            raise ValueError(f"memory.cache_bytes: {cache_bytes} ({format_bytes(cache_bytes)}){each} exceeds the "
                             f"{format_bytes(available)} of memory available on this host; give less, or leave "
                             f"it out for {CPU_CACHE_SHARE:.0%} of the available memory")
    check_within_cores(service.parallel.forward_threads, "parallel.forward_threads")


def default_cache_bytes(service) -> tuple[int, str]:
    """(cache_bytes of one rank, how it was chosen) for a service without memory.cache_bytes on a CPU."""
    available = available_memory_bytes()
    if available is None:
        raise ValueError("memory.cache_bytes: required here (this host's available memory is unknown)")
    ranks = ranks_on_host(service)
    total = min(int(available * CPU_CACHE_SHARE), CPU_CACHE_MAX_BYTES)
    split = f", split over {ranks} ranks" if ranks > 1 else ""
    how = (f"memory.cache_bytes not given: {CPU_CACHE_SHARE:.0%} of the {format_bytes(available)} available, "
           f"at most {format_bytes(CPU_CACHE_MAX_BYTES)}{split}")
    return total // ranks, how


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """Limit - usage of this process's memory cgroup (v2, or v1's memory controller), None without one."""
    root = Path("/sys/fs/cgroup")
    candidates = [(root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes")]
    try:
        own = next(line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        folder = root / own.lstrip("/")
        candidates.insert(0, (folder / "memory.max", folder / "memory.current"))
    except (OSError, StopIteration, IndexError):
        pass
    for limit_file, usage_file in candidates:
        try:
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
                return None
            return max(int(limit) - int(usage_file.read_text()), 0)
        except (OSError, ValueError):
            continue
    return None
