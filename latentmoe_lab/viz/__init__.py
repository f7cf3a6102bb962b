"""Plotly figure builders: pure functions from numbers to `go.Figure`, one module per topic.

    viz.model      parameters, expert load, cache bytes (the smoke report)
    viz.routing    router scores, group limits, imbalance workloads, balancing runs, latent and EP trade-offs
    viz.multimodal patches and merge windows, interleaved sequences, image costs, routing by modality
    viz.attention  KDA state and gates, chunked vs recurrent, indexer top-k, hybrid cost curves
    viz.parallel   who holds what, rank-to-rank traffic, measured vs planned bytes, schedules, full-scale plans
    viz.profiling  time per component by phase, scaling with prompt length, heaviest ops
    viz.alignment  error against depth, routing flips per MoE layer (alignment reports)
    viz.training   LM training runs: train / held-out loss curves, expert load over steps
"""
from latentmoe_lab.viz import alignment, attention, model, multimodal, parallel, profiling, routing, training
from latentmoe_lab.viz.model import (cache_bytes_figure, expert_load_figure, load_imbalance_figure,
                                     parameter_breakdown_figure)

__all__ = ["alignment", "attention", "model", "multimodal", "parallel", "profiling", "routing", "training",
           "cache_bytes_figure", "expert_load_figure", "load_imbalance_figure",
           "parameter_breakdown_figure"]
