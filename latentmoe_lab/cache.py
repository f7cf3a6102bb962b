"""Hybrid inference cache: constant-size state for KDA layers, a growing latent cache for DSA layers.

Per KDA layer the cache holds the short-conv tail (the last kernel-1 inputs of the
concatenated q|k|v channels) and the fp32 recurrent state S. Per Gated DSA layer it
holds only what MLA needs to rebuild attention: the normalised kv latent c_kv, the
(un-rotated) rope part of the key, and the lightning indexer's key. Nothing per head.
Layers read and write their own entry in place; the model advances `seq_len`.
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
    """latent: [B, S, kv_lora_rank]; k_rope: [B, S, rope_dim]; index_keys: [B, S, d_I]."""

    latent: torch.Tensor | None = None
    k_rope: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor, index_keys: torch.Tensor) -> None:
        """Append new tokens ([B, T, *] each) along the sequence dim."""
        def cat(old, new):
            return new if old is None else torch.cat([old, new], dim=1)

        self.latent = cat(self.latent, latent)
        self.k_rope = cat(self.k_rope, k_rope)
        self.index_keys = cat(self.index_keys, index_keys)


class HybridCache:
    """One entry per layer, in layer order; `seq_len` counts tokens already processed."""

    def __init__(self, config: ModelConfig):
        self.layers: list[KDALayerCache | DSALayerCache] = [
            DSALayerCache() if kind == DSA else KDALayerCache() for kind in config.layer_types
        ]
        self.seq_len = 0

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
