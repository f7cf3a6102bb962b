"""Tensor parallelism through torch's `parallelize_module`: one plan per block, applied over the "tp" mesh dim.

    KDA        q/k/v/b/f_up/g (its up half when low-rank) column-wise, o_proj row-wise;
               A_log, dt_bias Shard(0); the short conv keeps this rank's q | k | v channels;
               the per-head output norm is replicated with summed gradients
    Gated DSA  W_qb and W_gate column-wise, W_o row-wise; W_kvb Shard(0) (the absorbed form uses
               the weight itself); the latent K/V (W_kva's output) enters every rank's heads, so its
               gradient is summed over tp, and so is the latent norm's
    dense FFN, shared experts   w1, w3 column-wise, w2 row-wise
Everything else (norms, low-rank downs, the lightning indexer, router, latent projections, the
routed experts) is replicated over tp: every tp rank computes it on the same tokens, so its
gradients agree without any communication. The layer code is untouched; each layer's head count
and channel sizes are set to this rank's share, as torchtitan does for its attention.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.native.stage import named_blocks
from latentmoe_lab.native.local_params import REPLICATED_SUM, LocalParams, Sections, sum_gradients_over


def swiglu_plan(prefix: str) -> dict:
    return {f"{prefix}.w1": ColwiseParallel(), f"{prefix}.w3": ColwiseParallel(), f"{prefix}.w2": RowwiseParallel()}


def kda_plan(attn: KimiDeltaAttention, prefix: str) -> dict:
    key_width = attn.num_heads * attn.head_dim_k
    value_width = attn.num_heads * attn.head_dim_v
    gate = f"{prefix}.g_proj" if isinstance(attn.g_proj, nn.Linear) else f"{prefix}.g_proj.1"
    plan = {f"{prefix}.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_up")}
    plan |= {gate: ColwiseParallel(), f"{prefix}.o_proj": RowwiseParallel()}
    plan[prefix] = LocalParams({"A_log": Shard(0), "dt_bias": Shard(0), "o_norm.weight": REPLICATED_SUM,
                                "conv.weight": Sections((key_width, key_width, value_width))})
    return plan


def dsa_plan(prefix: str) -> dict:
    return {f"{prefix}.wq_b": ColwiseParallel(), f"{prefix}.w_gate": ColwiseParallel(),
            f"{prefix}.wo": RowwiseParallel(),
            prefix: LocalParams({"wkv_b.weight": Shard(0), "kv_norm.weight": REPLICATED_SUM})}


def _localize_kda(attn: KimiDeltaAttention, tp: int) -> None:
    attn.num_heads //= tp
    attn.conv_channels //= tp
    attn.conv.groups = attn.conv.in_channels = attn.conv.out_channels = attn.conv_channels


def apply_tensor_parallel(model, tp_mesh) -> None:
    """Shard `model`'s blocks over `tp_mesh` in place (the model may still be on the meta device)."""
    tp = tp_mesh.size()
    plan = {}
    for i, block in named_blocks(model):
        attn = block.attn
        if isinstance(attn, KimiDeltaAttention):
            plan |= kda_plan(attn, f"layers.{i}.attn")
            _localize_kda(attn, tp)
        elif isinstance(attn, GatedDSA):
            plan |= dsa_plan(f"layers.{i}.attn")
            attn.num_heads //= tp
            attn.wkv_a.register_forward_hook(lambda mod, args, out: sum_gradients_over(out, tp_mesh))
        ffn = block.ffn
        if isinstance(ffn, SwiGLU):
            plan |= swiglu_plan(f"layers.{i}.ffn")
        elif ffn.shared is not None:
            plan |= swiglu_plan(f"layers.{i}.ffn.shared")
    parallelize_module(model, tp_mesh, plan)
