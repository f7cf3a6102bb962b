"""FLOPs: torch.utils.flop_counter's formulas, ours for the custom ops, and the per-token budget (docs/design.md §16).

FLOPs here count the contractions (2 per multiply-add), as torch.utils.flop_counter does for mm, bmm,
convolutions and attention; elementwise ops, reductions and copies count 0 FLOPs and are judged by
their bytes. Our custom ops' formulas are registered in flop_counter's own registry, so a FlopCounterMode
run of the real model and the meta-device inventory count the same thing.

Per custom op (shapes as in porting/custom_ops.py):
    route_gate        2 N d E                       (the fp32 router matmul it fuses)
    grouped_matmul    2 M D F;  grouped_swiglu 2 M D (2F)
    kda_chunk         per head and chunk of C (T padded to whole chunks): 6 C^2 K + 4 C^2 V + C^3 + 6 C K V
                      (two C x C score matrices, the triangular solve, W and U, V' and the state, the output)
    kda_decode_step   per head: 6 K V               (k^T S, the rank-1 write, q^T S)
    index_topk        2 B T S HI (DI + 1)           (ReLU scores of every key, weighted sum over index heads)
    sparse_attention  2 B T H k (D + DV)            (logits and the weighted sum over the k selected rows)
    route_topk, dispatch_plan: 0 (selection and sorting, no contraction)

The budget `expected_flops` is the closed form the inventory must meet (within 2%, tests/test_porting_inventory.py):
    tokens x (2 x active text parameters + 2 d V)   (every weight once per token; the LM head, not in "active")
  + KDA layers x tokens x H x (6 C K + 4 C V + C^2 + 6 K V)      prefill (chunked)
                 x tokens x H x 6 K V                            decode (one step)
  + DSA layers x tokens x [2 HI (DI + 1) x keys + 2 H top_k (D + DV)]
    with keys = context + tokens / 2 for a prefill (causal), context + 1 for a decode, and the absorbed
    attention dims D = kv_lora_rank + qk_rope_head_dim (576), DV = kv_lora_rank (512).
"""
from __future__ import annotations

import functools
import json
import math

import torch
from torch.utils.flop_counter import register_flop_formula

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.porting import custom_ops  # noqa: F401  (registers torch.ops.latentmoe)

_ops = torch.ops.latentmoe


def _numel(shape) -> int:
    return math.prod(shape)


@register_flop_formula(_ops.route_gate)
def _route_gate_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * weight_shape[0]


@register_flop_formula([_ops.grouped_matmul, _ops.grouped_swiglu])
def _grouped_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * w_shape[1] * w_shape[2]


def kda_chunk_flops_per_head_token(chunk: int, dim_k: int, dim_v: int) -> int:
    """KDA chunk-form FLOPs per head per (padded) token: (6 C^2 K + 4 C^2 V + C^3 + 6 C K V) / C."""
    return 6 * chunk * dim_k + 4 * chunk * dim_v + chunk * chunk + 6 * dim_k * dim_v


@register_flop_formula(_ops.kda_chunk)
def _kda_chunk_flops(q_shape, k_shape, v_shape, g_shape, beta_shape, state_shape, scale, chunk_size,
                     out_shape=None, **kwargs) -> int:
    batch, seq_len, heads, dim_k = q_shape
    padded = math.ceil(seq_len / chunk_size) * chunk_size
    return batch * heads * padded * kda_chunk_flops_per_head_token(chunk_size, dim_k, v_shape[-1])


@register_flop_formula(_ops.kda_decode_step)
def _kda_decode_flops(state_shape, *args, out_shape=None, **kwargs) -> int:
    return 6 * _numel(state_shape)


@register_flop_formula(_ops.index_topk)
def _index_topk_flops(q_idx_shape, k_idx_shape, w_shape, k, offset, out_shape=None, **kwargs) -> int:
    batch, queries, heads, dim = q_idx_shape
    return 2 * batch * queries * k_idx_shape[1] * heads * (dim + 1)


@register_flop_formula(_ops.sparse_attention)
def _sparse_attention_flops(q_shape, k_shape, v_shape, indices_shape, scale, out_shape=None, **kwargs) -> int:
    batch, queries, heads, dim = q_shape
    return 2 * batch * queries * heads * indices_shape[-1] * (dim + v_shape[-1])


# ---------------------------------------------------------------------------------------- the budget
@functools.lru_cache(maxsize=8)
def _active_text_parameters(config_json: str) -> int:
    """meta.count_parameters' "active" less the vision tower's, once per config (a k3-2.8t build takes seconds)."""
    from latentmoe_lab.meta import count_parameters

    counts = count_parameters(ModelConfig.from_dict(json.loads(config_json)))
    return counts["active"] - counts["by_component"]["vision"]["active"]


def expected_flops(config: ModelConfig, phase: str, tokens: int, context: int) -> dict:
    """The closed-form forward FLOPs of `tokens` new text tokens (prefill: one sequence after `context` cached
    tokens; decode: `tokens` sequences, one token each, `context` cached each). Returns the parts and "total".

    Active parameters are meta.count_parameters' "active" less the vision tower's (a text forward skips it).
    """
    active = _active_text_parameters(config.to_json())
    kda, mla, idx = config.kda, config.mla, config.indexer
    dense = tokens * (2 * active + 2 * config.hidden_size * config.vocab_size)
    if phase == "prefill":
        chunk = kda.chunk_size
        per_token_kda = kda.num_heads * kda_chunk_flops_per_head_token(chunk, kda.head_dim_k, kda.head_dim_v)
        keys = context + tokens / 2
    else:
        per_token_kda = kda.num_heads * 6 * kda.head_dim_k * kda.head_dim_v
        keys = context + 1
    absorbed_qk, absorbed_v = mla.kv_lora_rank + mla.qk_rope_head_dim, mla.kv_lora_rank
    per_token_dsa = (2 * idx.num_heads * (idx.head_dim + 1) * keys
                     + 2 * mla.num_heads * idx.topk * (absorbed_qk + absorbed_v))
    parts = {"weights": dense, "kda": config.num_kda_layers * tokens * per_token_kda,
             "dsa": config.num_dsa_layers * tokens * per_token_dsa}
    return {**parts, "total": sum(parts.values())}
