"""Pure-PyTorch reference ops, each readable next to its math in docs/design.md."""
from latentmoe_lab.ops.backend import resolve_backend
from latentmoe_lab.ops.balancing import (RoutingStats, bias_update, expert_counts, load_stats, router_z_loss,
                                         routing_stats, sequence_aux_loss, sequence_aux_loss_reference)
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.kda_decode import kda_decode_step_
from latentmoe_lab.ops.norms import l2_norm, rms_norm
from latentmoe_lab.ops.paged_sparse import paged_index_topk, paged_sparse_attention
from latentmoe_lab.ops.routing import (DispatchPlan, combine, grouped_matmul, grouped_matmul_reference, grouped_swiglu,
                                       permute, plan_dispatch, route_and_plan, route_topk, route_topk_reference)
from latentmoe_lab.ops.sparse_attention import (dense_causal_attention, index_scores, index_topk, select_topk,
                                                select_topk_reference, sparse_attention)

__all__ = [
    "kda_chunked", "kda_recurrent", "l2_norm", "rms_norm", "DispatchPlan", "combine", "grouped_matmul",
    "grouped_matmul_reference", "permute", "plan_dispatch", "route_topk", "route_topk_reference",
    "dense_causal_attention", "index_scores", "select_topk", "select_topk_reference", "sparse_attention",
    "resolve_backend", "route_and_plan", "grouped_swiglu", "index_topk",
    "RoutingStats", "bias_update", "expert_counts", "load_stats", "router_z_loss", "routing_stats",
    "sequence_aux_loss", "sequence_aux_loss_reference", "paged_index_topk", "paged_sparse_attention",
    "kda_decode_step_",
]
