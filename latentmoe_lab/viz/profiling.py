"""Figures for profiling: time per component by phase, component time against prompt length, top ops,
and the per-rank compute / communication timeline (a Gantt chart of parallel.timeline intervals)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from latentmoe_lab.profiling import COMPONENTS


def phase_breakdown_figure(profile: Mapping[str, Mapping[str, float]],
                           title: str = "Where the time goes (share of component time)") -> go.Figure:
    """Stacked 100% bars: one bar per phase (prefill, decode), one segment per component."""
    phases = list(profile)
    fig = go.Figure()
    for component in COMPONENTS:
        shares = []
        for phase in phases:
            timed = {k: v for k, v in profile[phase].items() if k != "wall"}
            shares.append(timed.get(component, 0.0) / (sum(timed.values()) or 1.0))
        if any(shares):
            fig.add_trace(go.Bar(name=component, x=phases, y=shares))
    fig.update_layout(title=title, barmode="stack", yaxis_tickformat=".0%", yaxis_title="share")
    return fig


def scaling_figure(prompt_lens: Sequence[int], seconds: Mapping[str, Sequence[float]],
                   title: str = "Prefill time per component vs prompt length") -> go.Figure:
    """Lines of seconds per component (log-log), one point per prompt length."""
    fig = go.Figure([go.Scatter(x=list(prompt_lens), y=list(values), mode="lines+markers", name=name)
                     for name, values in seconds.items()])
    fig.update_layout(title=title, xaxis_type="log", yaxis_type="log", xaxis_title="prompt tokens",
                      yaxis_title="seconds")
    return fig


def top_ops_figure(rows: Sequence[Mapping], title: str = "Heaviest ops (self CPU time)") -> go.Figure:
    """Horizontal bars of the rows from `profiling.top_ops`."""
    rows = list(rows)[::-1]
    fig = go.Figure(go.Bar(x=[r["self_cpu_ms"] for r in rows], y=[r["name"] for r in rows], orientation="h",
                           text=[f"{r['share']:.0%} · {r['calls']} calls" for r in rows]))
    fig.update_layout(title=title, xaxis_title="ms")
    return fig


def timeline_figure(intervals: Sequence, title: str = "Compute and communication per rank") -> go.Figure:
    """Gantt chart of `parallel.timeline.Interval`s: two lanes per rank (compute, comm), ms from the first start.

    Bars are coloured by name (attn, moe.experts, moe.shared, "all_to_all ep.tokens", ...); hovering
    shows the bytes of a collective.
    """
    intervals = list(intervals)
    if not intervals:
        raise ValueError("intervals: nothing to draw (record_timelines returned no interval)")
    origin = min(i.start for i in intervals)
    fig = go.Figure()
    for name in sorted({i.name for i in intervals}):
        mine = [i for i in intervals if i.name == name]
        fig.add_trace(go.Bar(
            name=name, orientation="h", base=[(i.start - origin) * 1e3 for i in mine],
            x=[max((i.end - i.start) * 1e3, 1e-3) for i in mine], y=[f"rank {i.rank} {i.kind}" for i in mine],
            customdata=[i.nbytes for i in mine], hovertemplate=f"{name}<br>%{{base:.2f}} ms + %{{x:.3f}} ms"
                                                                 "<br>%{customdata} bytes<extra></extra>"))
    lanes = sorted({f"rank {i.rank} {i.kind}" for i in intervals}, reverse=True)
    fig.update_layout(title=title, barmode="overlay", xaxis_title="ms", height=120 + 40 * len(lanes),
                      yaxis=dict(categoryorder="array", categoryarray=lanes))
    return fig
