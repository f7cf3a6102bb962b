"""Plotly figure builders: pure functions from numbers to `go.Figure`, one module per topic.

    viz.model      parameters, expert load, cache bytes (the smoke report)
"""
from latentmoe_lab.viz import model
from latentmoe_lab.viz.model import (cache_bytes_figure, expert_load_figure, load_imbalance_figure,
                                     parameter_breakdown_figure)

__all__ = ["model", "cache_bytes_figure", "expert_load_figure", "load_imbalance_figure", "parameter_breakdown_figure"]
