"""Measure what an imbalance workload does: load, max/mean, dropped pairs, expert compute time.

The compute time is the layer's own expert step (`LatentExperts` on the expert-major rows that
`plan_dispatch` + `permute` produce), the median of `repeats` runs without autograd, the workloads
taking turns run by run. Two costs
the CPU time cannot show are reported as numbers:
- padded_rows: E * (rows of the busiest expert), what a padded batched matmul or a fixed
  per-expert capacity buffer computes, against the M = N * K rows that carry tokens;
- max_over_mean: under expert parallelism the busiest rank sets the step time.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.ops.balancing import RoutingStats, routing_stats
from latentmoe_lab.ops.routing import permute, plan_dispatch, route_topk
from latentmoe_lab.routing_workloads import Workload


@dataclass(frozen=True)
class WorkloadMeasurement:
    name: str
    stats: RoutingStats
    rows: int                          # N * K routed rows
    padded_rows: int                   # E * max count
    expert_seconds: float              # median LatentExperts forward
    phase_max_over_mean: list[float]   # per phase of the workload (one entry unless it rotates)


def interleaved_medians(fns: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall seconds of each function: one warm-up call each, then `repeats` rounds in which the
    functions take turns, so that a load spike on a shared machine hits all of them alike."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: must be a positive integer, got {repeats!r}")
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_workloads(workloads: Sequence[Workload], latent_size: int = 256, intermediate_size: int = 256,
                      capacity_factor: float = 1.25, repeats: int = 3, seed: int = 0) -> list[WorkloadMeasurement]:
    """Route each workload with `route_topk`, then time one set of random experts on its rows.

    All workloads must share N and E so that the times compare; the experts and the latent
    tokens z [N, latent_size] are drawn once from `seed`.
    """
    if not workloads:
        raise ValueError("workloads: expected at least one Workload")
    num_tokens, num_experts = workloads[0].logits.shape
    if any(tuple(w.logits.shape) != (num_tokens, num_experts) for w in workloads):
        raise ValueError(f"workloads: all logits must share shape ({num_tokens}, {num_experts}) [N, E]")
    torch.manual_seed(seed)
    experts = LatentExperts(num_experts, latent_size, intermediate_size)
    torch.nn.init.normal_(experts.w13, std=0.02)
    torch.nn.init.normal_(experts.w2, std=0.02)
    z = torch.randn(num_tokens, latent_size)
    routed = []
    for workload in workloads:
        _, indices = route_topk(workload.logits, workload.expected.shape[1])
        plan = plan_dispatch(indices, num_experts)
        routed.append((workload, indices, plan, permute(z, plan)))
    with torch.no_grad():
        seconds = interleaved_medians({str(i): (lambda z_perm=z_perm, plan=plan: experts(z_perm, plan.counts))
                                       for i, (_, _, plan, z_perm) in enumerate(routed)}, repeats)
    results = []
    for i, (workload, indices, plan, _) in enumerate(routed):
        phases = [routing_stats(indices[workload.phase == p], num_experts).max_over_mean
                  for p in workload.phase.unique().tolist()]
        results.append(WorkloadMeasurement(
            name=workload.name, stats=routing_stats(indices, num_experts, capacity_factor, workload.logits),
            rows=indices.numel(), padded_rows=num_experts * int(plan.counts.max()),
            expert_seconds=seconds[str(i)], phase_max_over_mean=phases))
    return results
