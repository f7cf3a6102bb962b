"""The service file's `prefix_cache:` section: where evicted prefix-cache blocks go (docs/design.md §15.3).

    prefix_cache:
      host_bytes   int  bytes of CPU memory for spilled blocks and KDA snapshots (default 0: no host tier)
      disk_dir     str  a directory for blocks spilled further (safetensors files with SHA-256 checksums);
                        one subdirectory per model-weights hash + cache dtype + block size (default: none)
      disk_bytes   int  the most bytes of files kept there (default: no bound); needs disk_dir

Absent or empty: no spill, an evicted block is simply forgotten. The spill needs prefix caching with at
least one snapshot slot (a hit is made of blocks AND the KDA snapshot at its end). It works with the forward
in the engine's process and on worker processes alike (parallel.forward_process, tp / ep / pp sizes > 1:
the rows are copied out of and into the workers' pools, serving/cache_tiers/spill_blocks.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from latentmoe_lab.config_fields import check, describe


@dataclass
class PrefixCacheSection:
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int | None = None

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None


def check_prefix_cache(section: PrefixCacheSection, memory) -> None:
    """The prefix_cache: section against the memory: section (types were checked by the loader)."""
    check(section.host_bytes >= 0, "prefix_cache.host_bytes",
          f"must be an integer >= 0 (0: no host tier), got {describe(section.host_bytes)}")
    check(section.disk_dir != "", "prefix_cache.disk_dir", "must not be empty (leave it out for no disk tier)")
    if section.disk_bytes is not None:
        check(section.disk_dir is not None, "prefix_cache.disk_bytes", "needs prefix_cache.disk_dir")
        check(section.disk_bytes >= 1, "prefix_cache.disk_bytes",
              f"must be a positive integer, got {describe(section.disk_bytes)}")
    if section.enabled:
        key = "prefix_cache.host_bytes" if section.disk_dir is None else "prefix_cache.disk_dir"
        check(memory.enable_prefix_caching, key,
              "spills the prefix cache: set memory.enable_prefix_caching true")
        check(memory.snapshot_slots >= 1, key,
              "needs memory.prefix_snapshot_slots >= 1 (a hit restores blocks with the KDA snapshot at their end)")
