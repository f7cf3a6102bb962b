"""The service file's cache hierarchy in one place, memory.prefix_cache and memory.offload (docs/design.md §15),
and the older keys it replaces.

    memory:
      prefix_cache:                  hash-chained block sharing + KDA state snapshots, and where evicted blocks go
        enabled          bool  default true (false: the section stays, prefix caching is off)
        snapshot_slots   int   KDA snapshot slots at block-aligned chunk ends, >= 0 (default memory.max_num_seqs)
        host_bytes       int   bytes of CPU memory for spilled blocks and KDA snapshots (default 0: no host tier)
        disk_dir         str   a directory for blocks spilled further (safetensors files with SHA-256 checksums);
                               one subdirectory per model-weights hash + cache dtype + block size (default: none)
        disk_bytes       int   the most bytes of files kept there (default: no bound); needs disk_dir
      offload:                       DSA latent rows in a host tier, the top-k rows of a decode swapped into a device
                                     hot buffer per sequence (§15.1)
        enabled          bool  default true (false: the section stays, every row on the device)
        host_cache_bytes int   bytes of the host tier (all DSA layers' latent + rope rows; required). It sets the
                               number of cache blocks together with the device budget (which then holds the
                               index keys, the hot buffers and the KDA slots)
        hot_rows_per_layer int device rows per running sequence and DSA layer (the hot buffer); at least
                               indexer.topk, checked against the model when the cache is planned (default 2 x topk)

A section left out or empty (null) is off; one written as a mapping is on unless `enabled: false`, which keeps
its keys (checked for names and types only) so one line turns it back on. The spill (host_bytes > 0 or a
disk_dir) needs at least one snapshot slot: a hit restores blocks AND the KDA snapshot at their end. It works
with the forward in worker processes too (the rows are copied out of and into the workers' pools,
spill_blocks.py). Code asks `memory.prefix_cache.enabled`, `.spills`, `memory.snapshot_slots` (0 when off) and
`memory.offload.enabled`: the loader turns an absent section into one with enabled false.

The older keys (DEPRECATED_KEYS) still load, each with one FutureWarning naming its replacement; giving one
together with memory.prefix_cache is an error naming both.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from latentmoe_lab.config_fields import check, check_field_types, check_positive_int, describe, section_from_dict

DEPRECATED_KEYS = {"memory.enable_prefix_caching": "memory.prefix_cache.enabled",
                   "memory.prefix_snapshot_slots": "memory.prefix_cache.snapshot_slots",
                   "prefix_cache": "memory.prefix_cache"}  # the top-level section of the spill tiers
MEMORY_KEYS = {"enable_prefix_caching": "enabled", "prefix_snapshot_slots": "snapshot_slots"}  # -> prefix_cache.*


@dataclass
class PrefixCacheSection:
    enabled: bool = True
    snapshot_slots: int | None = None  # None: memory.max_num_seqs (MemorySection.snapshot_slots resolves it)
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int | None = None

    path = "memory.prefix_cache"

    @property
    def spills(self) -> bool:
        """Evicted blocks go to a host or disk tier (the engine builds a SpillingBlockManager)."""
        return self.enabled and (self.host_bytes > 0 or self.disk_dir is not None)

    def check(self) -> None:
        """The keys' values on their own; check_spill_snapshots checks the snapshots a spill needs."""
        if self.snapshot_slots is not None:
            check(self.snapshot_slots >= 0, f"{self.path}.snapshot_slots",
                  f"must be an integer >= 0, got {describe(self.snapshot_slots)}")
        check(self.host_bytes >= 0, f"{self.path}.host_bytes",
              f"must be an integer >= 0 (0: no host tier), got {describe(self.host_bytes)}")
        check(self.disk_dir != "", f"{self.path}.disk_dir", "must not be empty (leave it out for no disk tier)")
        if self.disk_bytes is not None:
            check(self.disk_dir is not None, f"{self.path}.disk_bytes", f"needs {self.path}.disk_dir")
            check_positive_int(f"{self.path}.disk_bytes", self.disk_bytes)


@dataclass
class OffloadSection:
    enabled: bool = True
    host_cache_bytes: int | None = None
    hot_rows_per_layer: int | None = None

    path = "memory.offload"

    def check(self) -> None:
        check(self.host_cache_bytes is not None, f"{self.path}.host_cache_bytes",
              f"required with {self.path} (the bytes of the host tier that holds every DSA latent row)")
        for key in ("host_cache_bytes", "hot_rows_per_layer"):
            if getattr(self, key) is not None:
                check_positive_int(f"{self.path}.{key}", getattr(self, key))

    def hot_rows(self, topk: int) -> int:
        """hot_rows_per_layer for a model whose indexer keeps `topk` rows (its default 2 x topk)."""
        rows = 2 * topk if self.hot_rows_per_layer is None else self.hot_rows_per_layer
        if rows < topk:
            raise ValueError(f"{self.path}.hot_rows_per_layer: ({rows}) must be >= indexer.topk ({topk}): a "
                             f"decode step reads the top-k rows of a layer from its hot buffer at once")
        return rows


def cache_section(section_cls, value):
    """memory.prefix_cache / memory.offload as given (None, a mapping or a section) -> a checked section of
    `section_cls`; None -> one with enabled false. Values are checked only where the section is enabled."""
    if value is None:
        return section_cls(enabled=False)
    if isinstance(value, dict):
        value = section_from_dict(section_cls, value, section_cls.path)
    elif not isinstance(value, section_cls):
        keys = ", ".join(field.name for field in dataclasses.fields(section_cls))
        raise ValueError(f"{section_cls.path}: expected a mapping of keys ({keys}) or nothing, got {describe(value)}")
    check_field_types(value, prefix=f"{section_cls.path}.")
    if value.enabled:
        value.check()
    return value


def check_spill_snapshots(memory) -> None:
    """A spill restores blocks with the KDA snapshot at their end: it needs a snapshot slot (memory: a checked
    MemorySection, so memory.max_num_seqs is an int)."""
    section = memory.prefix_cache
    if section.spills:
        key = f"{section.path}.host_bytes" if section.disk_dir is None else f"{section.path}.disk_dir"
        check(memory.snapshot_slots >= 1, key, f"needs {section.path}.snapshot_slots >= 1 (a hit restores blocks "
              f"with the KDA snapshot at their end)")


def upgrade_cache_keys(data: dict) -> dict:
    """The sections of a service file with the deprecated keys moved into memory.prefix_cache, in the file and in
    its disaggregation roles' memory overrides: one FutureWarning each, ValueError naming both keys where
    memory.prefix_cache is given too."""
    memory = {} if data.get("memory") is None else data["memory"]
    if not isinstance(memory, dict):  # refused naming memory:, as without the old keys
        return without(data, "prefix_cache")
    old = {f"memory.{key}": memory[key] for key in MEMORY_KEYS if key in memory}
    if "prefix_cache" in data:
        old["prefix_cache"] = data["prefix_cache"]
    if old:
        announce(old, "", memory)
        memory = {**without(memory, *MEMORY_KEYS), "prefix_cache": file_section(old)}
        data = {**without(data, "prefix_cache"), "memory": memory}
    return upgrade_role_overrides(data, memory.get("prefix_cache"))


def file_section(old: dict) -> dict | None:
    """memory.prefix_cache of the file's deprecated keys `old`: none where memory.enable_prefix_caching is left out
    or false (its old default), and then, as before, a snapshot count or spill tier that would go unused is refused."""
    tiers = {} if old.get("prefix_cache") is None else old["prefix_cache"]
    if not isinstance(tiers, dict):
        raise ValueError(f"prefix_cache: expected a mapping of keys (or nothing), got {describe(tiers)}")
    slots = old.get("memory.prefix_snapshot_slots")
    enabled = old.get("memory.enable_prefix_caching", False)
    if enabled is not False:  # true, or a value that the type check refuses naming memory.prefix_cache.enabled
        return {"enabled": enabled, **({} if slots is None else {"snapshot_slots": slots}), **tiers}
    unused = {"memory.prefix_snapshot_slots": slots, **{f"prefix_cache.{key}": value for key, value in tiers.items()}}
    for key, value in unused.items():
        check(value in (None, 0), key, "serves prefix caching only, which the file leaves off "
              "(memory.enable_prefix_caching): set memory.prefix_cache.enabled true")
    return None


def upgrade_role_overrides(data: dict, section) -> dict:
    """disaggregation.<role>.memory's deprecated keys -> that role's memory.prefix_cache: the file's `section` with
    those keys changed (an override replaces a whole key, here the section)."""
    disagg = data.get("disaggregation")
    roles = {}
    for role in ("prefill", "decode") if isinstance(disagg, dict) else ():
        memory = disagg[role].get("memory") if isinstance(disagg.get(role), dict) else None
        old = {f"memory.{key}": memory[key] for key in MEMORY_KEYS if key in memory} if isinstance(memory, dict) else {}
        if old:
            announce(old, f"disaggregation.{role}.", memory)
            changed = {MEMORY_KEYS[key.split(".")[1]]: value for key, value in old.items()}
            base = section if isinstance(section, dict) else {"enabled": False}
            roles[role] = {**disagg[role], "memory": {**without(memory, *MEMORY_KEYS), "prefix_cache": base | changed}}
    return {**data, "disaggregation": disagg | roles} if roles else data


def announce(old: dict, prefix: str, memory: dict) -> None:
    """A FutureWarning per deprecated key in `old` (paths below `prefix`), after refusing them next to the section."""
    for key in old:
        check(memory.get("prefix_cache") is None, prefix + key, f"deprecated, and {prefix}memory.prefix_cache is "
              f"given too: give {prefix}{DEPRECATED_KEYS[key]} alone")
    for key in old:
        warnings.warn(f"{prefix}{key} is deprecated: use {prefix}{DEPRECATED_KEYS[key]}", FutureWarning, stacklevel=4)


def without(mapping: dict, *keys: str) -> dict:
    return {key: value for key, value in mapping.items() if key not in keys}
