"""KV-cache formats for a `memory.kv_cache_dtype` (docs/design.md §6.2, §7), and their bytes per token.

    auto  the model dtype (bf16 unless told)    bf16 / fp16 / fp32   unquantized (paged_pools.PlainFormat, the reference)
    fp8   MLA entry quant/kv_mla.py, index key quant/kv_index.py, e4m3 + fp32 scales
    int8  the same layouts with int8 codes
and, whatever kv_cache_dtype is, index keys in 4 bits when `memory.index_key_dtype` asks (quant/kv_index4.py):
    auto  the index key in kv_cache_dtype's format, as above
    int4 / fp4  two codes per byte + fp16 scales per 32 channels (72 B per token at k3-2.8t, against 132 in fp8)
Each format object implements the pools' storage protocol:
    bytes_per_token(dim) -> int
    allocate(num_blocks, block_size, dim, device) -> storage (uint8 [num_blocks, block_size * bytes_per_token]
                                                   for the quantized formats)
    write(storage, slot_mapping [N], values [N, dim]);  read(storage, positions [M]) -> [M, dim] fp32
with flat pool positions b * block_size + offset.
"""
from __future__ import annotations

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.paged_pools import PlainFormat
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat
from latentmoe_lab.quant.kv_index4 import FourBitIndexFormat
from latentmoe_lab.quant.kv_mla import QuantizedLatentFormat

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8")
INDEX_KEY_DTYPES = ("auto", "int4", "fp4")
PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kv_formats(config: ModelConfig, kv_cache_dtype: str, model_dtype: str = "bf16", index_key_dtype: str = "auto"):
    """(latent_format for [kv_lora + rope] MLA entries, index_format for [d_I] index keys)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if model_dtype not in PLAIN_DTYPES:
        raise ValueError(f"model_dtype: must be one of {sorted(PLAIN_DTYPES)}, got {model_dtype!r}")
    if index_key_dtype not in INDEX_KEY_DTYPES:
        raise ValueError(f"index_key_dtype: must be one of {INDEX_KEY_DTYPES}, got {index_key_dtype!r}")
    mla, index_dim = config.mla, config.indexer.head_dim
    if kv_cache_dtype in ("fp8", "int8"):
        latent, index = (QuantizedLatentFormat(mla.kv_lora_rank, mla.qk_rope_head_dim, kv_cache_dtype),
                         QuantizedIndexFormat(index_dim, kv_cache_dtype))
    else:
        latent = index = PlainFormat(PLAIN_DTYPES[model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype])
    return latent, index if index_key_dtype == "auto" else FourBitIndexFormat(index_dim, index_key_dtype)


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str, model_dtype: str = "bf16",
                       index_key_dtype: str = "auto") -> dict[str, int]:
    """{"mla": bytes, "index": bytes} per token per DSA layer; k3-2.8t with fp8 -> {"mla": 656, "index": 132}
    (index_key_dtype int4 or fp4: "index": 72)."""
    latent, index = kv_formats(config, kv_cache_dtype, model_dtype, index_key_dtype)
    latent_dim = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    return {"mla": latent.bytes_per_token(latent_dim), "index": index.bytes_per_token(config.indexer.head_dim)}
