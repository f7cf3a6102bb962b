"""The service file's `memory.offload:` section: DSA latent rows in a host tier (docs/design.md §15.1).

    memory:
      offload:                     absent or empty (null): every row on the device, as before
        host_cache_bytes    int    bytes of the host tier (all DSA layers' latent + rope rows; required).
                                   It sets the number of cache blocks together with the device budget
                                   (which then holds the index keys, the hot buffers and the KDA slots)
        hot_rows_per_layer  int    device rows per running sequence and DSA layer (the hot buffer); at
                                   least indexer.topk, checked against the model when the cache is planned
                                   (default 2 x indexer.topk)
"""
from __future__ import annotations

from dataclasses import dataclass

from latentmoe_lab.config_fields import check_field_types, describe, section_from_dict


@dataclass
class OffloadSection:
    host_cache_bytes: int | None = None
    hot_rows_per_layer: int | None = None

    def hot_rows(self, topk: int) -> int:
        """hot_rows_per_layer for a model whose indexer keeps `topk` rows (its default 2 x topk)."""
        rows = 2 * topk if self.hot_rows_per_layer is None else self.hot_rows_per_layer
        if rows < topk:
            raise ValueError(f"memory.offload.hot_rows_per_layer: ({rows}) must be >= indexer.topk ({topk}): a "
                             f"decode step reads the top-k rows of a layer from its hot buffer at once")
        return rows


def offload_section(value) -> OffloadSection | None:
    """memory.offload as given (None, a mapping or an OffloadSection) -> a checked OffloadSection or None."""
    if value is None or isinstance(value, OffloadSection):
        section = value
    elif isinstance(value, dict):
        section = section_from_dict(OffloadSection, value, "memory.offload")
    else:
        raise ValueError(f"memory.offload: expected a mapping of keys (host_cache_bytes, hot_rows_per_layer) or "
                         f"nothing, got {describe(value)}")
    if section is None:
        return None
    check_field_types(section, prefix="memory.offload.")
    if section.host_cache_bytes is None:
        raise ValueError("memory.offload.host_cache_bytes: required with memory.offload (the bytes of the host "
                         "tier that holds every DSA latent row)")
    for key in ("host_cache_bytes", "hot_rows_per_layer"):
        value = getattr(section, key)
        if value is not None and value < 1:
            raise ValueError(f"memory.offload.{key}: must be a positive integer, got {describe(value)}")
    return section
