"""Figures about parallel layouts: who holds what, who sends what, planned vs measured, full-scale plans."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def holdings_figure(ranks: Sequence[Mapping], num_layers: int, num_experts: int,
                    title: str = "Who holds which layers and experts") -> go.Figure:
    """Two heatmaps, rank x layer and rank x expert (1 = held). ranks: [{"rank", "layers", "experts", "coords"}]."""
    labels = [f"r{r['rank']} " + " ".join(f"{d}{v}" for d, v in r["coords"].items()) for r in ranks]
    layers = [[int(i in r["layers"]) for i in range(num_layers)] for r in ranks]
    experts = [[int(e in r["experts"]) for e in range(num_experts)] for r in ranks]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("decoder layers (pipeline stage)", "routed experts (EP shard)"),
                        column_widths=[0.35, 0.65], horizontal_spacing=0.08)
    for col, z in ((1, layers), (2, experts)):
        fig.add_trace(go.Heatmap(z=z, y=labels, colorscale=[[0, "#f0f0f0"], [1, "#2b6cb0"]], showscale=False,
                                 xgap=1, ygap=1), row=1, col=col)
    fig.update_xaxes(title_text="layer", row=1, col=1)
    fig.update_xaxes(title_text="expert", row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=120 + 40 * len(ranks))
    return fig


def traffic_matrix_figure(sent_to: Sequence[Mapping[int, int]], title: str = "Bytes sent rank to rank") -> go.Figure:
    """Heatmap [source rank, destination rank] of All-to-All + send bytes (one {dst: bytes} per source)."""
    n = len(sent_to)
    z = [[sent_to[src].get(dst, 0) for dst in range(n)] for src in range(n)]
    fig = go.Figure(go.Heatmap(z=z, x=[f"to r{d}" for d in range(n)], y=[f"r{s}" for s in range(n)],
                               colorscale="Blues", colorbar_title="bytes", text=z, texttemplate="%{text}"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, xaxis_title="destination", yaxis_title="source")
    return fig


def measured_vs_planned_figure(measured: Mapping[str, float], planned: Mapping[str, float],
                               title: str = "Bytes per collective: measured vs planner") -> go.Figure:
    """Grouped bars per tag (e.g. the sum over ranks of one layout's prefill)."""
    tags = sorted(set(measured) | set(planned))
    fig = go.Figure([go.Bar(name="measured", x=tags, y=[measured.get(t, 0) for t in tags]),
                     go.Bar(name="planned", x=tags, y=[planned.get(t, 0) for t in tags])])
    fig.update_layout(title=title, barmode="group", yaxis_title="bytes", xaxis_title="collective tag")
    return fig


def pipeline_schedule_figure(events: Sequence[Mapping], title: str = "Pipeline schedule") -> go.Figure:
    """Gantt bars per stage from `pipeline.simulate_schedule` events; F blue, B orange, label = micro-batch."""
    fig = go.Figure()
    for kind, color in (("F", "#4c78a8"), ("B", "#f58518")):
        chosen = [e for e in events if e["kind"] == kind]
        fig.add_trace(go.Bar(name="forward" if kind == "F" else "backward", orientation="h",
                             y=[f"stage {e['stage']}" for e in chosen], x=[e["end"] - e["start"] for e in chosen],
                             base=[e["start"] for e in chosen], marker_color=color,
                             text=[str(e["micro_batch"]) for e in chosen], textposition="inside"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, barmode="overlay", xaxis_title="time (forward = 1)")
    return fig


def memory_figure(names: Sequence[str], memory: Sequence[Mapping[str, float]], usable_bytes: float,
                  title: str = "Memory per device (fullest stage)") -> go.Figure:
    """Stacked bars of weights / grads / optimizer / kv_state / activations per layout, usable memory as a line."""
    parts = ("weights", "grads", "optimizer", "kv_state", "activations")
    fig = go.Figure([go.Bar(name=p, x=list(names), y=[m[p] / 1e9 for m in memory]) for p in parts])
    fig.add_hline(y=usable_bytes / 1e9, line_dash="dash", annotation_text="usable")
    fig.update_layout(title=title, barmode="stack", yaxis_title="GB")
    return fig


def step_time_figure(names: Sequence[str], times: Sequence[Mapping[str, Mapping[str, float]]],
                     phase: str = "prefill", title: str | None = None) -> go.Figure:
    """Grouped bars of the roofline step time per layout under each schedule for one phase."""
    schedules = ("sequential", "shared_overlap", "overlapped", "compute")
    fig = go.Figure([go.Bar(name=s, x=list(names), y=[t[phase][s] for t in times]) for s in schedules])
    fig.update_layout(title=title or f"Roofline {phase} step time", barmode="group", yaxis_title="seconds")
    return fig


def a2a_variants_figure(names: Sequence[str], traffic: Sequence[Mapping[str, float]],
                        title: str = "All-to-All bytes per MoE layer and device") -> go.Figure:
    """Bars of the four dispatch designs (pairs / grouped x hidden / latent) per layout."""
    variants = ("pairs_hidden", "grouped_hidden", "pairs_latent", "grouped_latent")
    fig = go.Figure([go.Bar(name=v, x=list(names), y=[t[f"a2a_{v}"] / 1e6 for t in traffic]) for v in variants])
    fig.update_layout(title=title, barmode="group", yaxis_title="MB (dispatch + combine)")
    return fig


def stage_balance_figure(values: Sequence[float], title: str = "Pipeline stage balance",
                         axis_title: str = "active parameters per token") -> go.Figure:
    """Bars of one cost per stage (planned cost or measured seconds); the dashed line is the mean."""
    fig = go.Figure(go.Bar(x=[f"stage {i}" for i in range(len(values))], y=list(values)))
    fig.add_hline(y=sum(values) / max(len(values), 1), line_dash="dash", annotation_text="mean")
    fig.update_layout(title=title, yaxis_title=axis_title)
    return fig
