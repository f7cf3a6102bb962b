"""Figures about hybrid attention: the KDA state and gates, chunked vs recurrent, the indexer's top-k, costs."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots


def kda_state_steps_figure(states: torch.Tensor, labels: Sequence[str] | None = None,
                           title: str = "KDA state S_t, token by token") -> go.Figure:
    """states: [T, K, V], the state after each token; a slider walks through t (rows: key channel).

    The figure opens on the step whose state holds the most (the latest of equals), not on a first step
    that may be nearly empty; ticks fall on whole channels.
    """
    states = states.detach().float()
    limit = float(states.abs().max()) or 1.0
    labels = list(labels) if labels is not None else [f"t={t}" for t in range(states.shape[0])]
    start = max(range(states.shape[0]), key=lambda t: (round(float(states[t].abs().sum()), 6), t))
    fig = go.Figure([go.Heatmap(z=state.tolist(), zmin=-limit, zmax=limit, colorscale="RdBu",
                                visible=(t == start), colorbar_title="S[k, v]") for t, state in enumerate(states)])
    steps = [dict(method="update", label=label, args=[{"visible": [i == t for i in range(len(labels))]}])
             for t, label in enumerate(labels)]
    fig.update_layout(title=title, sliders=[dict(active=start, steps=steps, currentvalue=dict(prefix="after "))],
                      xaxis_title="value channel v", yaxis_title="key channel k", yaxis_autorange="reversed")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(dtick=1)
    return fig


def decay_gates_figure(decays: Mapping[str, torch.Tensor], title: str = "Forget gates exp(g)") -> go.Figure:
    """decays: {name: [T, K] values exp(g) in [0, 1]}, one heatmap per name side by side."""
    names = list(decays)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, shared_yaxes=True)
    for col, name in enumerate(names, start=1):
        fig.add_trace(go.Heatmap(z=decays[name].detach().float().tolist(), zmin=0.0, zmax=1.0,
                                 colorscale="Viridis", showscale=col == len(names), colorbar_title="exp(g)"),
                      row=1, col=col)
        fig.update_xaxes(title_text="key channel", row=1, col=col)
    fig.update_yaxes(title_text="token", autorange="reversed", row=1, col=1)
    fig.update_layout(title=title)
    return fig


def chunked_vs_recurrent_figure(reference: torch.Tensor, chunked: torch.Tensor, max_points: int = 4000,
                                title: str = "kda_chunked against kda_recurrent") -> go.Figure:
    """Scatter of output elements (an even sample of at most max_points): recurrent on x, chunked on y.

    They should sit on y = x; the title gives the largest difference over all elements, not just the sample.
    """
    x, y = reference.detach().float().flatten(), chunked.detach().float().flatten()
    worst = float((x - y).abs().max()) if x.numel() else 0.0
    low, high = (float(x.min()), float(x.max())) if x.numel() else (0.0, 1.0)
    step = max(1, -(-x.numel() // max_points))
    x, y = x[::step], y[::step]
    fig = go.Figure([go.Scattergl(x=x.tolist(), y=y.tolist(), mode="markers", marker=dict(size=3), name="outputs"),
                     go.Scatter(x=[low, high], y=[low, high], mode="lines", line=dict(dash="dash"), name="y = x")])
    fig.update_layout(title=f"{title} (max |diff| = {worst:.1e})", xaxis_title="recurrent", yaxis_title="chunked")
    return fig


def topk_pattern_figure(scores: torch.Tensor, selected: torch.Tensor,
                        title: str = "Lightning-indexer scores and the top-k each query keeps") -> go.Figure:
    """scores: [T, S] index scores (causal part shown); selected: [T, k] positions (-1 pads) drawn as dots."""
    scores = scores.detach().float()
    causal = torch.ones_like(scores, dtype=torch.bool).tril(diagonal=scores.shape[1] - scores.shape[0])
    shown = scores.masked_fill(~causal, float("nan"))
    rows, slots = torch.nonzero(selected >= 0, as_tuple=True)
    cols = selected[rows, slots]
    fig = go.Figure([go.Heatmap(z=shown.tolist(), colorscale="Blues", colorbar_title="I[t, s]"),
                     go.Scatter(x=cols.tolist(), y=rows.tolist(), mode="markers", name="selected",
                                marker=dict(size=4, color="crimson", symbol="square"))])
    fig.update_layout(title=title, xaxis_title="key position s", yaxis_title="query position t",
                      yaxis_autorange="reversed")
    return fig


def cost_curves_figure(contexts: Sequence[int], series: Mapping[str, Sequence[float]], yaxis_title: str,
                       title: str, log_y: bool = True) -> go.Figure:
    """One line per series against context length (log x): costs, bytes or timings."""
    fig = go.Figure([go.Scatter(x=list(contexts), y=list(values), mode="lines+markers", name=name)
                     for name, values in series.items()])
    fig.update_layout(title=title, xaxis_title="context length (tokens)", yaxis_title=yaxis_title,
                      xaxis_type="log", yaxis_type="log" if log_y else "linear")
    return fig


def hybrid_ratio_figure(rows: Sequence[Mapping[str, float]],
                        title: str = "Token mixers per generated token") -> go.Figure:
    """rows: analysis.attention_cost.ratio_table output. Left: FLOPs, right: state bytes, one line per ratio."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["compute (FLOPs / token)", "cache + state (bytes)"])
    ratios = list(dict.fromkeys(row["kda_per_dsa"] for row in rows))
    for ratio in ratios:
        mine = [row for row in rows if row["kda_per_dsa"] == ratio]
        name = _ratio_name(ratio)
        contexts = [row["context"] for row in mine]
        fig.add_trace(go.Scatter(x=contexts, y=[row["flops"] for row in mine], name=name, legendgroup=name,
                                 mode="lines+markers"), row=1, col=1)
        fig.add_trace(go.Scatter(x=contexts, y=[row["state_bytes"] for row in mine], name=name, legendgroup=name,
                                 mode="lines+markers", showlegend=False), row=1, col=2)
    first = [row for row in rows if row["kda_per_dsa"] == ratios[0]]
    for col, key in ((1, "dense_flops"), (2, "dense_state_bytes")):
        fig.add_trace(go.Scatter(x=[row["context"] for row in first], y=[row[key] for row in first],
                                 name="all dense MLA", legendgroup="dense", showlegend=col == 1,
                                 line=dict(dash="dash", color="black")), row=1, col=col)
    fig.update_xaxes(type="log", title_text="context length (tokens)")
    fig.update_yaxes(type="log")
    fig.update_layout(title=title)
    return fig


def hybrid_breakdown_figure(cost: Mapping[str, float], title: str | None = None) -> go.Figure:
    """cost: one analysis.attention_cost.hybrid_cost row. Stacked KDA / DSA bars next to all-dense MLA."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["GFLOPs / token", "GB kept for the sequence"])
    for col, (unit, scale) in enumerate((("flops", 1e9), ("state_bytes", 1e9)), start=1):
        for kind, color in (("kda", "#636efa"), ("dsa", "#ef553b")):
            fig.add_trace(go.Bar(x=["hybrid", "dense MLA"], y=[cost[f"{kind}_{unit}"] / scale, 0.0],
                                 name=f"{cost[kind + '_layers']} {kind.upper()} layers", marker_color=color,
                                 legendgroup=kind, showlegend=col == 1), row=1, col=col)
        fig.add_trace(go.Bar(x=["hybrid", "dense MLA"], y=[0.0, cost[f"dense_{unit}"] / scale], name="dense MLA",
                             marker_color="gray", legendgroup="dense", showlegend=col == 1), row=1, col=col)
    fig.update_layout(barmode="stack", title=title or (f"{_ratio_name(cost['kda_per_dsa'])} at "
                                                       f"{cost['context']:,} tokens of context"))
    return fig


def recall_curve_figure(steps: Sequence[int], recall: Sequence[float], loss: Sequence[float],
                        title: str = "Indexer warm-up") -> go.Figure:
    """Top-k recall of dense attention mass (left axis) and KL loss (right axis) over training steps."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=list(steps), y=list(recall), name="top-k recall", mode="lines+markers"))
    fig.add_trace(go.Scatter(x=list(steps), y=list(loss), name="KL loss", mode="lines", line=dict(dash="dot")),
                  secondary_y=True)
    fig.update_layout(title=title, xaxis_title="step")
    fig.update_yaxes(title_text="recall", secondary_y=False)
    fig.update_yaxes(title_text="KL(p || softmax(I))", secondary_y=True)
    return fig


def _ratio_name(kda_per_dsa: float) -> str:
    if kda_per_dsa == float("inf"):
        return "all KDA"
    return "all Gated DSA" if kda_per_dsa == 0 else f"{kda_per_dsa}:1 KDA:DSA"


def depth_weights_figure(weights: Sequence[Sequence[float]], sublayers: Sequence[str], sources: Sequence[str],
                         title: str = "Block AttnRes: mean weight of each source, per sublayer") -> go.Figure:
    """Heatmap [sublayer, source] of the AttnRes softmax averaged over tokens; empty cells are sources that
    do not exist yet at that depth."""
    fig = go.Figure(go.Heatmap(z=[[None if v is None else float(v) for v in row] for row in weights],
                               x=list(sources), y=list(sublayers), colorscale="Viridis", zmin=0, zmax=1,
                               colorbar={"title": "weight"}))
    fig.update_layout(title=title, xaxis_title="source (candidate)", yaxis_title="sublayer input",
                      yaxis_autorange="reversed", height=max(300, 22 * len(sublayers) + 150))
    return fig
