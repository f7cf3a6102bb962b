"""Bytes one request's transfer carries, planned from the config alone (docs/design.md §13.1).

    dsa_latent   L_dsa x N x latent entry   (k3-2.8t fp8: 656 B = 512 codes + 4 x 4 scales + 64 x 2 rope)
    dsa_index    L_idx x N x index entry    (k3-2.8t fp8: 132 B = 128 codes + 4 scale); L_idx: the DSA layers
                                            with their own indexer (all of them unless dsa.index_share_every > 1)
    kda_state    L_kda x H x d_k x d_v x 4  (fp32, memory.state_dtype's default; bf16: x 2; int8: the stored
                                            rows, L_kda x H x d_k x (d_v + 4 + d_v / 2) bytes, quant/kda_state.py)
    kda_conv     L_kda x channels x (kernel - 1) x compute dtype bytes (bf16: x 2; int8: per group of
                                            G channels and column, G + 4 bytes)
    mtp_hidden   hidden_size x compute dtype bytes with an MTP head (the row the decode side drafts from), else 0
    sampler      the torch.Generator state (the CPU generator's, 5056 B)

These are the payload's tensor bytes: RequestCache.tensor_bytes() of an exported request equals
bytes_per_request exactly (tests). The wire adds a JSON header and a 32-byte checksum (wire.py).
"""
from __future__ import annotations

import math

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.paged_pools import kda_shapes, slot_layout
from latentmoe_lab.quant.kda_state import kda_slot_formats
from latentmoe_lab.quant.kv import PLAIN_DTYPES, kv_bytes_per_token

GENERATOR_STATE_BYTES = torch.Generator().get_state().numel()


def payload_shapes(config: ModelConfig, prompt_len: int, cache_dtype: str, model_dtype: str = "bf16",
                   state_dtype: str = "fp32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor of a RequestCache for a prompt of prompt_len tokens.

    cache_dtype: memory.kv_cache_dtype resolved (fp8 | int8 | bf16 | fp16 | fp32); model_dtype: the
    compute dtype of the conv tails (bf16 | fp16 | fp32); state_dtype: memory.state_dtype (fp32 | bf16 | int8).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"model_config: expected a ModelConfig, got {type(config).__name__}")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len: must be an integer >= 1, got {prompt_len!r}")
    if model_dtype not in PLAIN_DTYPES:
        raise ValueError(f"model_dtype: must be one of {sorted(PLAIN_DTYPES)}, got {model_dtype!r}")
    if cache_dtype == "auto":
        raise ValueError("cache_dtype: give the resolved format (ServiceConfig.cache_dtype), not 'auto'")
    entry = kv_bytes_per_token(config, cache_dtype, model_dtype)
    formats = kda_slot_formats(state_dtype, PLAIN_DTYPES[model_dtype], config.kda.head_dim_k, config.kda.head_dim_v)
    (state, state_type), (conv, conv_type) = (slot_layout(f, shape) for f, shape in zip(formats, kda_shapes(config)))
    return {"generator_state": ((GENERATOR_STATE_BYTES,), torch.uint8),
            "dsa_latent": ((config.num_dsa_layers, prompt_len, entry["mla"]), torch.uint8),
            "dsa_index": ((config.num_indexer_layers, prompt_len, entry["index"]), torch.uint8),
            "kda_state": ((config.num_kda_layers, *state), state_type),
            "kda_conv": ((config.num_kda_layers, *conv), conv_type),
            "mtp_hidden": ((1 if config.mtp_depth > 0 else 0, config.hidden_size), PLAIN_DTYPES[model_dtype])}


def transfer_bytes_by_kind(config: ModelConfig, prompt_len: int, cache_dtype: str,
                           model_dtype: str = "bf16", state_dtype: str = "fp32") -> dict[str, int]:
    """Payload bytes by tensor: generator_state, dsa_latent, dsa_index, kda_state, kda_conv, mtp_hidden."""
    shapes = payload_shapes(config, prompt_len, cache_dtype, model_dtype, state_dtype)
    return {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for name, (shape, dtype) in shapes.items()}


def bytes_per_request(model_config: ModelConfig, prompt_len: int, cache_dtype: str, model_dtype: str = "bf16",
                      state_dtype: str = "fp32") -> int:
    """Payload tensor bytes of one request of prompt_len tokens (what a transfer measures, exactly)."""
    return sum(transfer_bytes_by_kind(model_config, prompt_len, cache_dtype, model_dtype, state_dtype).values())


def transfer_table(model_config: ModelConfig, prompt_len: int, cache_dtype: str, model_dtype: str = "bf16") -> str:
    """A few lines for plan-service: the payload of one prompt_len-token request, by kind."""
    from latentmoe_lab.meta import format_bytes

    kinds = transfer_bytes_by_kind(model_config, prompt_len, cache_dtype, model_dtype)
    lines = [f"prefill -> decode transfer of one {prompt_len:,}-token request ({cache_dtype} cache), payload:"]
    lines += [f"  {name:<18}{format_bytes(value):>14}" for name, value in kinds.items()]
    lines.append(f"  {'total':<18}{format_bytes(sum(kinds.values())):>14}")
    return "\n".join(lines)
