"""Figures about accuracy alignment: error against depth, routing flips per MoE layer (docs/design.md §8).

Builders take plain rows (dicts with the fields of `alignment.compare.TapRow`), so they run on saved
reports too; nothing here runs a model.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from latentmoe_lab.viz.model import decades_axis

_DEPTH_KINDS = ("residual", "attn", "ffn", "router_logits")


def _depth(row: Mapping, num_layers: int) -> float:
    """x position: embed at -1, block i at i, the final norm and logits after the last block."""
    if row["layer"] is not None:
        return float(row["layer"])
    return {"embed": -1.0, "norm": num_layers, "logits": num_layers + 0.5}[row["kind"]]


def _positive(value: float | None) -> float | None:
    """rel L2 on a log axis: exact zeros would vanish, so they sit at 1e-12 (hover shows the real value)."""
    if value is None or not math.isfinite(value):
        return None
    return max(value, 1e-12)


def alignment_figure(rows: Sequence[Mapping], title: str = "Alignment against the reference",
                     first_divergence: str | None = None) -> go.Figure:
    """Two panels: relative L2 error per tap kind against depth (log scale), and routing flips per MoE layer."""
    layers = [r["layer"] for r in rows if r["layer"] is not None]
    num_layers = max(layers) + 1 if layers else 0
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38],
                        subplot_titles=("relative L2 error against depth", "routing flips per MoE layer"))
    ends = [r for r in rows if r["kind"] in ("embed", "norm", "logits")]
    for kind in _DEPTH_KINDS:
        chosen = [r for r in rows if r["kind"] == kind]
        if kind == "residual":
            chosen = sorted(chosen + ends, key=lambda r: _depth(r, num_layers))
        if not chosen:
            continue
        fig.add_trace(go.Scatter(
            x=[_depth(r, num_layers) for r in chosen], y=[_positive(r["rel_l2"]) for r in chosen],
            mode="lines+markers", name="residual stream" if kind == "residual" else kind,
            text=[f"{r['name']}<br>rel L2 {r['rel_l2']:.3e}<br>cosine {r['cosine']:.6f}" for r in chosen],
            hoverinfo="text"), row=1, col=1)
    if first_divergence is not None:
        hit = next((r for r in rows if r["name"] == first_divergence), None)
        if hit is not None and hit["rel_l2"] is not None:
            fig.add_trace(go.Scatter(x=[_depth(hit, num_layers)], y=[_positive(hit["rel_l2"])], mode="markers",
                                     name=f"first divergence: {first_divergence}",
                                     marker=dict(symbol="x", size=14, color="crimson")), row=1, col=1)
    flips = [r for r in rows if r["kind"] == "experts"]
    fig.add_trace(go.Bar(x=[f"layer {r['layer']}" for r in flips], y=[r["routing_flips"] for r in flips],
                         name="tokens with a changed expert set", marker_color="darkorange"), row=1, col=2)
    if not any(r["routing_flips"] for r in flips):  # an all-zero panel would look like a missing chart
        fig.add_annotation(text="no routing flips:<br>every MoE layer chose the<br>same experts for every token"
                           if flips else "no MoE layer was compared", showarrow=False, x=0.5, y=0.5,
                           xref="x2 domain", yref="y2 domain")
    fig.update_xaxes(title_text="block (embed at -1, norm and logits after the last)", row=1, col=1)
    errors = [_positive(r["rel_l2"]) for r in rows if _positive(r["rel_l2"]) is not None]
    fig.update_yaxes(title_text="|cand - ref| / |ref|", **decades_axis(errors), row=1, col=1)
    fig.update_yaxes(title_text="share of tokens", rangemode="tozero", row=1, col=2)
    fig.update_layout(title=title, height=450)
    return fig
