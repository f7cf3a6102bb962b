"""Hybrid inference cache: constant-size state for KDA layers, a growing latent cache for DSA layers.

Per KDA layer the cache holds the short-conv tail (the last kernel-1 inputs of the
concatenated q|k|v channels) and the fp32 recurrent state S. Per Gated DSA layer it
holds only what MLA needs to rebuild attention: the normalised kv latent c_kv, the
(un-rotated) rope part of the key, and the lightning indexer's key. Nothing per head.
Layers read and write their own entry in place; the model advances `seq_len`.

A forward writes layer after layer, so one that stops part-way (an exception, a KeyboardInterrupt)
leaves the early layers holding the new tokens and the late ones not. The model then marks the cache
invalid (`invalidate`), and `check_usable` refuses it from then on, as it refuses a cache built for
another layer pattern or batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from latentmoe_lab.config import DSA, ModelConfig


@dataclass
class KDALayerCache:
    """conv_state: [B, channels, kernel-1]; recurrent_state: [B, H, d_k, d_v] fp32."""

    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None


@dataclass
class DSALayerCache:
    """latent: [B, S, kv_lora_rank]; k_rope: [B, S, rope_dim]; index_keys: [B, S, d_I].

    After an append the three are views into two buffers that double their capacity when full, so a
    decode step writes one token instead of copying the whole cache. One buffer holds [c_kv | k_rope]
    per token: `absorbed_keys` is that [B, S, kv_lora_rank + rope_dim] key of absorbed MLA, copy-free.
    The buffers are written in place (an inference cache: no gradient flows through old entries).
    """

    latent: torch.Tensor | None = None
    k_rope: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._keys: torch.Tensor | None = None  # [B, capacity, kv_lora_rank + rope_dim]
        self._index: torch.Tensor | None = None  # [B, capacity, d_I]

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def absorbed_keys(self) -> torch.Tensor | None:
        """[B, S, kv_lora_rank + rope_dim]: c_kv and k_rope side by side (a view when the buffers hold them)."""
        if self.latent is None:
            return None
        if self._keys is not None and self.latent.data_ptr() == self._keys.data_ptr():
            return self._keys[:, :self.length]
        return torch.cat([self.latent, self.k_rope], dim=-1)

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor, index_keys: torch.Tensor) -> None:
        """Append new tokens ([B, T, *] each) along the sequence dim; amortised O(T) per call."""
        old, new = self.length, self.length + latent.shape[1]
        keys = torch.cat([latent, k_rope], dim=-1)
        if self._keys is None or self._keys.shape[1] < new or self.latent.data_ptr() != self._keys.data_ptr():
            self._keys = _grown(self.absorbed_keys, keys, new)
            self._index = _grown(self.index_keys, index_keys, new)
        self._keys[:, old:new] = keys
        self._index[:, old:new] = index_keys
        latent_dim = latent.shape[-1]
        self.latent = self._keys[:, :new, :latent_dim]
        self.k_rope = self._keys[:, :new, latent_dim:]
        self.index_keys = self._index[:, :new]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens: a speculative draft's rows are dropped. The buffers keep the
        dropped rows, and the next append overwrites them (it writes from `length` on)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length: must be an integer in [0, {self.length}], got {length!r}")
        if self.latent is not None:
            self.latent, self.k_rope = self.latent[:, :length], self.k_rope[:, :length]
            self.index_keys = self.index_keys[:, :length]


def _grown(held: torch.Tensor | None, incoming: torch.Tensor, needed: int) -> torch.Tensor:
    """A buffer [B, capacity, D] with room for `needed` tokens (at least double the old), `held` copied in."""
    old = 0 if held is None else held.shape[1]
    buffer = incoming.new_empty(incoming.shape[0], max(needed, 2 * old), incoming.shape[-1])
    if held is not None:
        buffer[:, :old] = held
    return buffer


class HybridCache:
    """One entry per layer, in layer order; `seq_len` counts tokens already processed."""

    def __init__(self, config: ModelConfig):
        self.layers: list[KDALayerCache | DSALayerCache] = [
            DSALayerCache() if kind == DSA else KDALayerCache() for kind in config.layer_types
        ]
        self.seq_len = 0
        self.invalid_reason: str | None = None

    def invalidate(self, reason: str) -> None:
        """Mark the cache unusable (a forward over it did not finish); check_usable raises from then on."""
        self.invalid_reason = reason

    @property
    def batch_size(self) -> int | None:
        """Rows the cache holds (None before the first forward)."""
        for entry in self.layers:
            for f in fields(entry):
                tensor = getattr(entry, f.name)
                if tensor is not None:
                    return tensor.shape[0]
        return None

    def check_usable(self, config: ModelConfig, batch_size: int) -> None:
        """Raise ValueError unless this cache is valid and was built for `config`'s layers and this batch size."""
        if self.invalid_reason is not None:
            raise ValueError(f"cache: unusable, a forward over it did not finish ({self.invalid_reason}), so some "
                             f"layers hold its tokens and others do not; start again from model.new_cache()")
        if len(self.layers) != config.num_layers:
            raise ValueError(f"cache: has {len(self.layers)} layer entries, the model has {config.num_layers}")
        for i, (entry, kind) in enumerate(zip(self.layers, config.layer_types)):
            if isinstance(entry, DSALayerCache) != (kind == DSA):
                raise ValueError(f"cache: entry {i} is a {type(entry).__name__} but layer {i} of the model is "
                                 f"{kind!r}; build the cache with this model's new_cache()")
        held = self.batch_size
        if held is not None and held != batch_size:
            raise ValueError(f"cache: holds {held} rows but input_ids has batch size {batch_size}")

    def __getitem__(self, layer_idx: int) -> KDALayerCache | DSALayerCache:
        return self.layers[layer_idx]

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held, split into kda_conv, kda_state, dsa_latent, dsa_rope and dsa_index."""
        names = {"conv_state": "kda_conv", "recurrent_state": "kda_state", "latent": "dsa_latent",
                 "k_rope": "dsa_rope", "index_keys": "dsa_index"}
        totals = dict.fromkeys(names.values(), 0)
        for entry in self.layers:
            for f in fields(entry):
                tensor = getattr(entry, f.name)
                if tensor is not None:
                    totals[names[f.name]] += tensor.numel() * tensor.element_size()
        return totals
