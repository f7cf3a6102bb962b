"""Figures about routing: scores and picks, group limits, workloads, balancing runs, latent and EP trade-offs.

Every builder takes plain numbers (lists, tensors or the dataclasses of latentmoe_lab.analysis)
and returns a go.Figure; nothing here runs a model.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def _rows(matrix) -> list[list[float]]:
    return [[float(v) for v in row] for row in matrix]


def router_scores_figure(scores, indices, title: str = "Router scores s = sigmoid(W_r x); picks marked") -> go.Figure:
    """Heatmap of scores [N, E] with the chosen experts indices [N, K] marked by circles."""
    fig = go.Figure(go.Heatmap(z=_rows(scores), colorscale="Blues", colorbar_title="score"))
    picks = [(int(e), n) for n, row in enumerate(indices) for e in row]
    fig.add_trace(go.Scatter(x=[e for e, _ in picks], y=[n for _, n in picks], mode="markers", name="top-k",
                             marker=dict(symbol="circle-open", size=12, color="crimson", line_width=2)))
    fig.update_layout(title=title, xaxis_title="expert", yaxis_title="token", yaxis_autorange="reversed")
    return fig


def group_limit_figure(choice, n_group: int, kept_groups: Sequence[int], selected: Sequence[int],
                       title: str = "Group-limited top-k for one token") -> go.Figure:
    """Bars of one token's biased scores choice [E]: picked, eligible (kept group), or masked to -inf."""
    values = [float(v) for v in choice]
    per_group = len(values) // n_group
    kept, picked = set(int(g) for g in kept_groups), set(int(e) for e in selected)
    status = ["picked" if e in picked else "eligible" if e // per_group in kept else "masked (-inf)"
              for e in range(len(values))]
    colors = {"picked": "crimson", "eligible": "steelblue", "masked (-inf)": "lightgray"}
    fig = go.Figure()
    for name, color in colors.items():
        experts = [e for e, s in enumerate(status) if s == name]
        fig.add_trace(go.Bar(x=experts, y=[values[e] for e in experts], name=name, marker_color=color))
    for g in range(1, n_group):
        fig.add_vline(x=g * per_group - 0.5, line_dash="dot", line_color="gray")
    fig.update_layout(title=title, xaxis_title="expert (dotted lines separate groups)",
                      yaxis_title="s + b", barmode="overlay")
    return fig


def workload_load_figure(loads: Mapping[str, Sequence[float]], title: str = "Load / mean load per expert"
                         ) -> go.Figure:
    """Heatmap, one row per workload: tokens per expert divided by the mean (1 = fair share)."""
    names = list(loads)
    rows = []
    for name in names:
        counts = [float(c) for c in loads[name]]
        mean = sum(counts) / len(counts)
        rows.append([c / mean if mean else 0.0 for c in counts])
    fig = go.Figure(go.Heatmap(z=rows, y=names, colorscale="Magma", colorbar_title="x mean"))
    fig.update_layout(title=title, xaxis_title="expert")
    return fig


def workload_summary_figure(names: Sequence[str], max_over_mean: Sequence[float], expert_ms: Sequence[float],
                            padded_over_rows: Sequence[float], title: str = "Imbalance workloads") -> go.Figure:
    """Three bar panels per workload: max/mean load, measured expert time (ms), padded rows / real rows."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("max / mean load (EP step slowdown)",
                                                        "expert compute, ms (measured)",
                                                        "padded rows / routed rows"))
    for col, values in enumerate((max_over_mean, expert_ms, padded_over_rows), start=1):
        fig.add_trace(go.Bar(x=list(names), y=[float(v) for v in values], showlegend=False), row=1, col=col)
    fig.update_layout(title=title)
    return fig


def balancing_figure(max_over_mean: Mapping[str, Sequence[float]], loss: Mapping[str, Sequence[float]] | None = None,
                     title: str = "Expert load during training (mean over MoE layers)") -> go.Figure:
    """Per-step max/mean load for each balancing mode; a second panel with the loss when given."""
    panels = 2 if loss else 1
    fig = make_subplots(rows=panels, cols=1, shared_xaxes=True,
                        subplot_titles=("max / mean tokens per expert", "cross-entropy")[:panels])
    for i, (mode, curve) in enumerate(max_over_mean.items()):
        color = ("gray", "crimson", "steelblue", "darkorange", "seagreen")[i % 5]
        fig.add_trace(go.Scatter(y=[float(v) for v in curve], name=mode, mode="lines", line_color=color,
                                 legendgroup=mode), row=1, col=1)
        if loss:
            fig.add_trace(go.Scatter(y=[float(v) for v in loss[mode]], name=mode, mode="lines", line_color=color,
                                     legendgroup=mode, showlegend=False), row=2, col=1)
    fig.add_hline(y=1.0, line_dash="dash", row=1, col=1)
    fig.update_xaxes(title_text="step", row=panels, col=1)
    fig.update_layout(title=title, height=300 * panels + 100)
    return fig


def latent_tradeoff_figure(points, selected_alpha: int | None = None,
                           title: str = "Latent size trade-off, relative to alpha = 1") -> go.Figure:
    """Grouped bars per alpha (LatentPoint list): each metric divided by its alpha = 1 value."""
    metrics = {"experts": "num_experts", "top-k": "top_k", "bytes per expert": "expert_bytes",
               "all routed expert bytes": "routed_expert_bytes", "payload bytes / token": "payload_bytes_per_token",
               "expert FLOPs / token": "expert_flops_per_token"}
    base = points[0]
    fig = go.Figure()
    for p in points:
        ratios = [getattr(p, field) / getattr(base, field) for field in metrics.values()]
        highlight = selected_alpha is None or p.alpha == selected_alpha
        fig.add_trace(go.Bar(x=list(metrics), y=ratios, name=f"alpha={p.alpha} (l={p.latent_size})",
                             opacity=1.0 if highlight else 0.3))
    fig.update_layout(title=title, barmode="group", yaxis_title=f"x value at alpha={base.alpha}")
    fig.update_yaxes(**_powers_of_two_axis([trace_y for trace in fig.data for trace_y in trace.y]))
    return fig


def _powers_of_two_axis(ratios: Sequence[float]) -> dict:
    """A log axis labelled at the powers of two the ratios span (x1/8 .. x8), not at every minor tick."""
    low = math.floor(math.log2(min(r for r in ratios if r > 0)))
    high = math.ceil(math.log2(max(ratios)))
    values = [2.0 ** e for e in range(low, high + 1)]
    text = [f"x{int(v)}" if v >= 1 else f"x1/{int(round(1 / v))}" for v in values]
    return dict(type="log", tickvals=values, ticktext=text, range=[low * math.log10(2) - 0.1,
                                                                   high * math.log10(2) + 0.1])


def ep_ranks_figure(loads, title: str = "One MoE layer per expert-parallel rank") -> go.Figure:
    """RankLoad list -> panels: rows per local expert, dispatch MB per rank, expert weight GB per rank."""
    labels = [f"EP={r.ep}" for r in loads]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("rows per local expert", "dispatch MB per rank",
                                                        "expert weights GB per rank"))
    fig.add_trace(go.Bar(x=labels, y=[r.rows_per_expert for r in loads], showlegend=False), row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=[r.send_bytes_per_copy / 1e6 for r in loads], name="one copy per expert"),
                  row=1, col=2)
    fig.add_trace(go.Bar(x=labels, y=[r.send_bytes_per_rank_dedup / 1e6 for r in loads], name="one copy per rank"),
                  row=1, col=2)
    fig.add_trace(go.Bar(x=labels, y=[r.expert_weight_bytes / 1e9 for r in loads], showlegend=False), row=1, col=3)
    fig.update_layout(title=title, barmode="group")
    return fig


def bias_rule_figure(names: Sequence[str], max_over_mean: Mapping[str, Sequence[float]],
                     title: str = "One bias update per workload: max / mean load after it") -> go.Figure:
    """Grouped bars: for each rule (e.g. "no bias", "sign", "quantile") its max/mean load on each workload."""
    fig = go.Figure()
    for rule, values in max_over_mean.items():
        fig.add_trace(go.Bar(x=list(names), y=[float(v) for v in values], name=rule))
    fig.add_hline(y=1.0, line_dash="dash")
    fig.update_layout(title=title, barmode="group", yaxis_title="max / mean tokens per expert")
    return fig

