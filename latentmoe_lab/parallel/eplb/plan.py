"""The load balancer on paper: a placement's balancedness and the layout planner's (parallel/planner.py)
busiest-rank step time (docs/design.md §14).

    study = plan_placement(config, pconfig, hardware, workload, weight, redundant_experts=64)

weight [L_moe, E] is the load of every MoE layer (e.g. `workload_loads` of one of the six imbalance
workloads). With redundant_experts=None the layout is the balancer-free one (expert e in slot e, ranks
holding contiguous ranges); otherwise rebalance_experts (refine=True by default) places E + R slots, with
num_nodes = ep / hardware.devices_per_node and the model's expert groups. The planner then models the
busiest EP rank of every MoE layer: its experts receive max / mean x the average routed pairs
(parallel/roofline.py), and it holds the (E + R) / ep slots in memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.load import balance_metrics, rank_loads
from latentmoe_lab.parallel.eplb.rebalance import default_placement, rebalance_experts
from latentmoe_lab.parallel.hardware import Hardware, Workload
from latentmoe_lab.parallel.planner import LayoutPlan, plan_layout
from latentmoe_lab.routing_workloads import make_workload


def workload_loads(name: str, num_layers: int, num_experts: int, top_k: int, num_tokens: int = 4096,
                   seed: int = 0) -> torch.Tensor:
    """[num_layers, E] tokens per expert: workload `name` drawn once, its expert ids shuffled per layer
    (seed + layer), so that the hot experts differ from layer to layer as they do in a real model."""
    counts = make_workload(name, num_tokens, num_experts, top_k, seed=seed).counts.double()
    return torch.stack([counts[torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed + layer))]
                        for layer in range(num_layers)])


@dataclass
class PlacementStudy:
    redundant_experts: int | None      # None: no balancer
    balancedness: float                # mean over MoE layers of mean / max tokens per rank
    imbalance: float                   # mean over MoE layers of (max - mean) / mean
    rebalance_seconds: float           # rebalance_experts on the whole table (0 without a balancer)
    plan: LayoutPlan                   # memory of the fullest rank, the busiest rank's step times


def plan_placement(config: ModelConfig, pconfig: ParallelConfig, hardware: Hardware, workload: Workload,
                   weight: torch.Tensor, redundant_experts: int | None, refine: bool = True) -> PlacementStudy:
    """Balance `weight` [L_moe, E] over pconfig.ep ranks (module docstring) and plan the layout; refine:
    rebalance_experts' packing-aware replica counts (False: the public balancer alone)."""
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    num_experts = config.moe.num_experts
    if tuple(weight.shape) != (len(moe_layers), num_experts):
        raise ValueError(f"weight: expected shape ({len(moe_layers)}, {num_experts}) [MoE layers, experts], "
                         f"got {tuple(weight.shape)}")
    start = time.perf_counter()
    if redundant_experts is None:
        phy2log, _, logcnt = default_placement(len(moe_layers), num_experts)
    else:
        nodes = max(1, pconfig.ep // hardware.devices_per_node)
        phy2log, _, logcnt = rebalance_experts(weight, num_experts + redundant_experts, config.moe.n_group,
                                               nodes, pconfig.ep, refine=refine)
    seconds = time.perf_counter() - start if redundant_experts is not None else 0.0
    metrics = balance_metrics(rank_loads(weight, phy2log, logcnt, pconfig.ep))
    factors = dict(zip(moe_layers, (1.0 / metrics["balancedness_per_layer"]).tolist()))  # max / mean
    plan = plan_layout(config, pconfig, hardware, workload, redundant_experts=redundant_experts or 0,
                       expert_load=factors)
    return PlacementStudy(redundant_experts, metrics["balancedness"], metrics["imbalance"], seconds, plan)
