"""Numbers derived from a config or a measurement: latent trade-offs, expert-parallel ranks, workload imbalance,
token-mixer cost (KDA, Gated DSA, hybrid ratios), peak tensor memory of a computation."""
from latentmoe_lab.analysis.attention_cost import (MixerCost, dsa_cost, gqa_cache_bytes, hybrid_cost, kda_cost,
                                                   layer_counts, ratio_table)
from latentmoe_lab.analysis.imbalance import WorkloadMeasurement, interleaved_medians, measure_workloads
from latentmoe_lab.analysis.latent import (LatentPoint, RankLoad, expert_parallel_ranks, iso_communication,
                                           latent_tradeoff)
from latentmoe_lab.analysis.memory import PeakMemory

__all__ = ["WorkloadMeasurement", "interleaved_medians", "measure_workloads", "LatentPoint", "RankLoad",
           "expert_parallel_ranks", "iso_communication", "latent_tradeoff", "MixerCost", "dsa_cost",
           "gqa_cache_bytes", "hybrid_cost", "kda_cost", "layer_counts", "ratio_table", "PeakMemory"]
