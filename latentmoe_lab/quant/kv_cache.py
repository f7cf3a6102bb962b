"""The contiguous twin of quantized paged pools: a HybridCache whose DSA entries hold what a KV codec returns.

Every token appended to a `CodecDSALayerCache` goes through `format.write` then `format.read` (the codecs of
quant/kv_*.py; their scales are per token, so the decoded values do not depend on where a token sits in a
block), and the cache keeps the decoded values. The layers then attend over exactly what attention over an
fp8 / int8 paged pool sees, new tokens included, so `model(ids, cache=quantized_kv_cache(...))` gives the logits
of every position under a quantized KV cache (held-out bits per byte), and greedy decoding over it is the
reference for the paged engine with the same formats. Memory is not saved here: it is a numerical twin.
"""
from __future__ import annotations

import torch

from latentmoe_lab.cache import DSALayerCache, HybridCache
from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.quant.kv import kv_formats


def codec_round_trip(fmt, values: torch.Tensor) -> torch.Tensor:
    """values [N, dim] -> what a pool in `fmt` returns for them, fp32 [N, dim]."""
    storage = fmt.allocate(1, max(values.shape[0], 1), values.shape[1], values.device)
    positions = torch.arange(values.shape[0], device=values.device)
    fmt.write(storage, positions, values)
    return fmt.read(storage, positions)


class CodecDSALayerCache(DSALayerCache):
    """A DSALayerCache storing latent / rope / index keys after a round trip through the given formats."""

    def __init__(self, latent_format, index_format):
        super().__init__()
        self.latent_format, self.index_format = latent_format, index_format

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor, index_keys: torch.Tensor) -> None:
        """latent [B, T, kv_lora], k_rope [B, T, rope], index_keys [B, T, d_I], stored decoded in their dtypes."""
        batch, steps, kv_lora = latent.shape
        flat = torch.cat([latent, k_rope], dim=-1).detach().reshape(batch * steps, -1)
        decoded = codec_round_trip(self.latent_format, flat).to(latent.dtype).reshape(batch, steps, -1)
        keys = codec_round_trip(self.index_format, index_keys.detach().reshape(batch * steps, -1))
        super().append(decoded[..., :kv_lora], decoded[..., kv_lora:],
                       keys.to(index_keys.dtype).reshape(batch, steps, -1))


def quantized_kv_cache(config: ModelConfig, kv_cache_dtype: str, model_dtype: str = "bf16",
                       index_key_dtype: str = "auto") -> HybridCache:
    """A fresh HybridCache for `config` whose DSA layers store values as a `kv_cache_dtype` pool returns them
    (index keys as an `index_key_dtype` pool: memory.index_key_dtype)."""
    latent_format, index_format = kv_formats(config, kv_cache_dtype, model_dtype, index_key_dtype)
    cache = HybridCache(config)
    cache.layers = [CodecDSALayerCache(latent_format, index_format) if kind == DSA else entry
                    for kind, entry in zip(config.layer_types, cache.layers)]
    return cache
