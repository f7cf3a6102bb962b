"""use_custom_ops(): run the model's layers through the `torch.ops.latentmoe` custom ops (opt-in).

The layers call the reference ops by the names they imported (latentmoe_lab.layers.kda's `kda_chunked`,
layers.moe's `route_topk`, ...). Inside the block those names point at thin wrappers that call the custom
ops of porting/custom_ops.py; on exit the originals come back. The model's default forward, its numerics
and its tests are untouched: this is the form a vendor port, torch.export and the operator inventory use.

A call the custom op does not cover keeps its reference (packed sequences' `first_key` in the indexer,
routing without renormalisation, a KDA single step that needs gradients), so the block never changes
what a forward computes, only how it is dispatched.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from latentmoe_lab.layers import dsa as dsa_layer
from latentmoe_lab.layers import dsa_indexer as indexer_layer
from latentmoe_lab.layers import kda as kda_layer
from latentmoe_lab.layers import moe as moe_layer
from latentmoe_lab.ops.kda import resolve_scale
from latentmoe_lab.ops.routing import DispatchPlan
from latentmoe_lab.porting.custom_ops import OPS

_ORIGINAL = {
    (kda_layer, "kda_chunked"): kda_layer.kda_chunked,
    (kda_layer, "kda_recurrent"): kda_layer.kda_recurrent,
    (moe_layer, "route_topk"): moe_layer.route_topk,
    (moe_layer, "plan_dispatch"): moe_layer.plan_dispatch,
    (moe_layer, "grouped_matmul"): moe_layer.grouped_matmul,
    (moe_layer, "grouped_experts_fit"): moe_layer.grouped_experts_fit,
    (indexer_layer, "index_topk"): indexer_layer.index_topk,
    (dsa_layer, "sparse_attention"): dsa_layer.sparse_attention,
    (dsa_layer, "masked_form_pays"): dsa_layer.masked_form_pays,
}


def _kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                 backend="auto"):
    o, state = OPS["kda_chunk"](q, k, v, g, beta, initial_state, resolve_scale(scale, q.shape[-1]), chunk_size)
    return o, state if output_final_state else None


def _kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    """One token ([B, 1, H, *]) without gradients: the decode-step op; anything else: the reference."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (q, k, v, g, beta, initial_state))
    if q.shape[1] != 1 or needs_grad:
        return _ORIGINAL[(kda_layer, "kda_recurrent")](q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       backend)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in (q, k, v, g, beta)) else torch.float32
    batch, _, heads, dim_k = q.shape
    state = (q.new_zeros(batch, heads, dim_k, v.shape[-1], dtype=dtype) if initial_state is None
             else initial_state.to(dtype))
    o, state = OPS["kda_decode_step"](state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                      resolve_scale(scale, dim_k))
    return o[:, None], state if output_final_state else None


def _route_topk(logits, top_k, bias=None, n_group=1, topk_group=1, renormalize=True, scaling=1.0, backend="auto"):
    if not renormalize:
        return _ORIGINAL[(moe_layer, "route_topk")](logits, top_k, bias, n_group, topk_group, renormalize, scaling,
                                                     backend)
    return OPS["route_topk"](logits, bias, top_k, n_group, topk_group, float(scaling))


def _plan_dispatch(indices, num_experts):
    order, counts = OPS["dispatch_plan"](indices, num_experts)
    return DispatchPlan(order=order, token_index=order // indices.shape[1], counts=counts, offsets=counts.cumsum(0),
                        top_k=indices.shape[1])


def _grouped_matmul(x, w, offsets, impl="auto", backend="auto"):
    return OPS["grouped_matmul"](x, w, offsets)


def _grouped_experts_fit(z, w13, w2):
    """Never: the CPU's fused torch._grouped_mm experts are a host-specific kernel choice, so a ported model
    runs its experts as two latentmoe.grouped_matmul calls around the SwiGLU (LatentExperts.forward_tiles)."""
    return False


def _fused_routed_applies(z):
    """Never: the fused CPU pass over expert tiles (ops.routed_experts) is a host kernel choice too, so a ported
    model's MoE runs the steps path (dispatch plan, grouped matmuls, combine) at every size."""
    return False


def _index_topk(q_idx, k_idx, w, k, offset=0, first_key=None, backend="auto"):
    if first_key is not None:  # packed sequences: the reference handles the per-query first key
        return _ORIGINAL[(indexer_layer, "index_topk")](q_idx, k_idx, w, k, offset, first_key, backend)
    return OPS["index_topk"](q_idx, k_idx, w, k, offset)


def _masked_form_pays(num_keys, slots):
    """Never: scoring every key under a mask (ops/sparse_attention_masked.py) is a CPU kernel choice, so a ported
    model attends through latentmoe.sparse_attention at every length."""
    return False


def _sparse_attention(q, k, v, indices, scale=None, backend="auto"):
    return OPS["sparse_attention"](q, k, v, indices, q.shape[-1] ** -0.5 if scale is None else float(scale))


_WRAPPERS = {
    (kda_layer, "kda_chunked"): _kda_chunked,
    (kda_layer, "kda_recurrent"): _kda_recurrent,
    (moe_layer, "route_topk"): _route_topk,
    (moe_layer, "plan_dispatch"): _plan_dispatch,
    (moe_layer, "grouped_matmul"): _grouped_matmul,
    (moe_layer, "grouped_experts_fit"): _grouped_experts_fit,
    (moe_layer, "on_torch_backend"): _fused_routed_applies,
    (indexer_layer, "index_topk"): _index_topk,
    (dsa_layer, "sparse_attention"): _sparse_attention,
    (dsa_layer, "masked_form_pays"): _masked_form_pays,
}


@contextlib.contextmanager
def use_custom_ops() -> Iterator[None]:
    """Inside the block, every model's KDA, routing, grouped-GEMM and sparse-attention calls go through
    torch.ops.latentmoe (re-entrant: an inner block leaves the outer one's wrappers in place)."""
    previous = {key: getattr(*key) for key in _WRAPPERS}
    for (module, name), wrapper in _WRAPPERS.items():
        setattr(module, name, wrapper)
    try:
        yield
    finally:
        for (module, name), value in previous.items():
            setattr(module, name, value)
