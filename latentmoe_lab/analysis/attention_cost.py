"""Token-mixer cost per generated token, from a ModelConfig: KDA, Gated DSA, dense MLA, and their mixes.

For one new token at context length S (decode), per layer (2 FLOPs per multiply-add):

    KDA        projections + 7 H d_k d_v for the state update      state: H d_k d_v fp32, constant in S
    Gated DSA  projections + 2 H_I d_I S (index every key)
               + 2 H (2 r + p) n, n = min(S, top-k)  (absorbed MQA attention over the selected latent)
                                                      cache: S (r + p) bf16 + S (d_I FP8 + one fp32 scale)
    dense MLA  the same without the indexer, over all S keys (n = S); cache S (r + p) bf16

with r = kv_lora_rank, p = qk_rope_head_dim. The 7 H d_k d_v of KDA: decay the state (1), predict
S^T k (2), write k u^T (2), read S^T q (2), each per element of the [d_k, d_v] state. A model with
`kda_per_dsa` = r puts Gated DSA at every (r + 1)-th layer and the last (config.default_layer_types);
r = inf means KDA everywhere. MoE / FFN cost is left out: it is the same in every variant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from latentmoe_lab.config import DSA, ModelConfig, default_layer_types

KDA_STATE_BYTES = 4  # fp32 recurrent state (docs/design.md §4)
ACTIVATION_BYTES = 2  # bf16: conv tails, MLA latent cache
INDEX_KEY_BYTES = 1  # FP8 index keys ...
INDEX_SCALE_BYTES = 4  # ... plus one fp32 scale per token


@dataclass(frozen=True)
class MixerCost:
    """One layer, one new token at a given context: FLOPs to compute it and bytes kept for the sequence."""

    flops: float
    state_bytes: float


def kda_cost(config: ModelConfig, context: int) -> MixerCost:
    """A KDA layer: cost and state do not depend on `context`."""
    _check(config, context)
    kda, d = config.kda, config.hidden_size
    keys, values = kda.num_heads * kda.head_dim_k, kda.num_heads * kda.head_dim_v
    output_gate = d * values if kda.output_gate_rank is None else kda.output_gate_rank * (d + values)
    weights = d * (2 * keys + values) + d * kda.num_heads + kda.gate_rank * (d + keys) + output_gate + values * d
    conv_channels = 2 * keys + values
    flops = 2 * weights + 2 * kda.conv_kernel * conv_channels + 7 * kda.num_heads * kda.head_dim_k * kda.head_dim_v
    state = (KDA_STATE_BYTES * kda.num_heads * kda.head_dim_k * kda.head_dim_v
             + ACTIVATION_BYTES * conv_channels * (kda.conv_kernel - 1))
    return MixerCost(flops=float(flops), state_bytes=float(state))


def dsa_cost(config: ModelConfig, context: int, sparse: bool = True) -> MixerCost:
    """A Gated DSA layer at `context`; sparse=False is the same MLA attending densely (no indexer, no index cache)."""
    _check(config, context)
    mla, idx, d = config.mla, config.indexer, config.hidden_size
    heads, latent, rope = mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
    weights = (d * mla.q_lora_rank + mla.q_lora_rank * heads * (mla.qk_nope_head_dim + rope)
               + d * (latent + rope) + heads * mla.qk_nope_head_dim * latent  # W_kb folded into the query
               + heads * latent * mla.v_head_dim  # W_vb after the softmax
               + 2 * d * heads * mla.v_head_dim)  # output gate and W_o
    attended = min(context, idx.topk) if sparse else context
    flops = 2 * weights + 2 * heads * (2 * latent + rope) * attended
    state = ACTIVATION_BYTES * (latent + rope) * context
    if sparse:
        flops += 2 * (mla.q_lora_rank * idx.num_heads * idx.head_dim + d * idx.head_dim + d * idx.num_heads)
        flops += 2 * idx.num_heads * idx.head_dim * context
        state += (INDEX_KEY_BYTES * idx.head_dim + INDEX_SCALE_BYTES) * context
    return MixerCost(flops=float(flops), state_bytes=float(state))


def gqa_cache_bytes(layers: int, kv_heads: int, head_dim: int, seq_len: int, bytes_per_value: float) -> float:
    """Plain GQA KV cache: 2 (K and V) x layers x kv_heads x head_dim x seq_len x bytes (docs/design.md §1.6)."""
    return 2.0 * layers * kv_heads * head_dim * seq_len * bytes_per_value


def layer_counts(config: ModelConfig, kda_per_dsa: float) -> tuple[int, int]:
    """(KDA layers, DSA layers) when Gated DSA sits at every (kda_per_dsa + 1)-th layer and the last."""
    if kda_per_dsa == math.inf:
        return config.num_layers, 0
    if isinstance(kda_per_dsa, bool) or not isinstance(kda_per_dsa, int) or kda_per_dsa < 0:
        raise ValueError(f"kda_per_dsa: expected an integer >= 0 or math.inf, got {kda_per_dsa!r}")
    dsa = default_layer_types(config.num_layers, kda_per_dsa + 1, final_layer_dsa=True).count(DSA)
    return config.num_layers - dsa, dsa


def hybrid_cost(config: ModelConfig, context: int, kda_per_dsa: float = 3) -> dict:
    """All token mixers of the model for one new token at `context`.

    Returns flops and state_bytes (whole model) plus the kda_layers / dsa_layers split and
    the same totals for an all-dense-MLA model as dense_flops / dense_state_bytes.
    """
    kda_layers, dsa_layers = layer_counts(config, kda_per_dsa)
    kda, dsa, dense = kda_cost(config, context), dsa_cost(config, context), dsa_cost(config, context, sparse=False)
    return dict(context=context, kda_per_dsa=kda_per_dsa, kda_layers=kda_layers, dsa_layers=dsa_layers,
                kda_flops=kda_layers * kda.flops, dsa_flops=dsa_layers * dsa.flops,
                kda_state_bytes=kda_layers * kda.state_bytes, dsa_state_bytes=dsa_layers * dsa.state_bytes,
                flops=kda_layers * kda.flops + dsa_layers * dsa.flops,
                state_bytes=kda_layers * kda.state_bytes + dsa_layers * dsa.state_bytes,
                dense_flops=config.num_layers * dense.flops, dense_state_bytes=config.num_layers * dense.state_bytes)


def ratio_table(config: ModelConfig, contexts: list[int], ratios: list[float]) -> list[dict]:
    """hybrid_cost for every (context, kda_per_dsa) pair, contexts outer."""
    return [hybrid_cost(config, context, ratio) for context in contexts for ratio in ratios]


def _check(config: ModelConfig, context: int) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context: expected a positive integer, got {context!r}")
