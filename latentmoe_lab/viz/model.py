"""Figures about the whole model: parameters by component, expert load, cache bytes."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go


def parameter_breakdown_figure(by_component: Mapping[str, Mapping[str, int]], title: str = "Parameters") -> go.Figure:
    """Grouped bars of total vs active-per-token parameters. by_component: {name: {"total", "active"}}."""
    names = list(by_component)
    fig = go.Figure([
        go.Bar(name="total", x=names, y=[by_component[n]["total"] for n in names]),
        go.Bar(name="active per token", x=names, y=[by_component[n]["active"] for n in names]),
    ])
    fig.update_layout(title=title, barmode="group", yaxis_title="parameters")
    fig.update_yaxes(**decades_axis([v for counts in by_component.values() for v in counts.values()]))
    return fig


def decades_axis(values: Sequence[float]) -> dict:
    """A log axis from the decade below the smallest positive value to the decade above the largest, labelled
    at powers of ten only: the tallest bar stays under a labelled tick, and no minor "2" / "5" labels."""
    positive = [v for v in values if v > 0]
    if not positive:
        return dict(type="log")
    return dict(type="log", dtick=1, range=[math.floor(math.log10(min(positive))),
                                            math.ceil(math.log10(max(positive)) + 1e-9)])


def expert_load_figure(load: Sequence[Sequence[float]], layer_labels: Sequence[str],
                       title: str = "Tokens per expert") -> go.Figure:
    """Heatmap of load [layers, experts] (tokens routed to each expert in each MoE layer).

    The first layer is drawn at the top, as in every layer-by-expert heatmap of viz (modality routing too).
    """
    fig = go.Figure(go.Heatmap(z=[list(row) for row in load], y=list(layer_labels), colorscale="Viridis",
                               colorbar_title="tokens"))
    fig.update_layout(title=title, xaxis_title="expert", yaxis_title="layer", yaxis_autorange="reversed")
    return fig


def load_imbalance_figure(max_over_mean: Sequence[float], layer_labels: Sequence[str],
                          title: str = "Expert load imbalance (max / mean)") -> go.Figure:
    """Bars of max/mean tokens per expert for each MoE layer; 1.0 is perfect balance."""
    fig = go.Figure(go.Bar(x=list(layer_labels), y=list(max_over_mean)))
    fig.add_hline(y=1.0, line_dash="dash", annotation_text="balanced")
    fig.update_layout(title=title, xaxis_title="layer", yaxis_title="max / mean")
    return fig


def cache_bytes_figure(bytes_by_kind: Mapping[str, int], title: str = "Cache bytes by kind") -> go.Figure:
    """Bars of cache bytes per kind (kda_conv, kda_state, dsa_latent, dsa_rope, dsa_index)."""
    fig = go.Figure(go.Bar(x=list(bytes_by_kind), y=list(bytes_by_kind.values())))
    fig.update_layout(title=title, yaxis_title="bytes")
    return fig
