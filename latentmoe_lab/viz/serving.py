"""Figures for the serving engine: a step timeline and latency histograms (docs/design.md §6.6).

They take the engine's records (serving.metrics.StepRecord / RequestMetrics), not the engine itself.
"""
from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def timeline_figure(steps: Sequence, num_blocks: int | None = None,
                    title: str = "Engine timeline: sequences, blocks and tokens per step") -> go.Figure:
    """Three rows against seconds since the first step: running / waiting sequences; blocks and slots
    used (scaled to what is used; the pool's size, num_blocks, is named in the panel's title, since a line
    at a pool of thousands of blocks would flatten the use to zero); prefill and decode tokens of each step,
    stacked bars as wide as the step took, so a slow run's steps stay visible."""
    steps = list(steps)
    t0 = steps[0].time - steps[0].duration if steps else 0.0
    x = [s.time - t0 for s in steps]
    pool = "" if num_blocks is None else f" (blocks and slots used; the pool holds {num_blocks:,} blocks)"
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("sequences", "cache" + pool, "tokens per step"))
    fig.add_trace(go.Scatter(x=x, y=[s.running for s in steps], name="running", line_shape="hv"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[s.waiting for s in steps], name="waiting", line_shape="hv"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[s.blocks_used for s in steps], name="blocks used", line_shape="hv"), 2, 1)
    fig.add_trace(go.Scatter(x=x, y=[s.slots_used for s in steps], name="KDA slots used", line_shape="hv"), 2, 1)
    widths = [s.duration for s in steps]  # each bar spans its step: [end - duration, end]
    offsets = [-w for w in widths]
    fig.add_trace(go.Bar(x=x, y=[s.prefill_tokens for s in steps], width=widths, offset=offsets,
                         name="prefill tokens"), 3, 1)
    fig.add_trace(go.Bar(x=x, y=[s.decode_tokens for s in steps], width=widths, offset=offsets,
                         name="decode tokens"), 3, 1)
    preempted = [(xi, s.running) for xi, s in zip(x, steps) if s.preemptions]
    if preempted:
        fig.add_trace(go.Scatter(x=[p[0] for p in preempted], y=[p[1] for p in preempted], mode="markers",
                                 marker_symbol="x", marker_size=10, name="preemption"), 1, 1)
    fig.update_layout(title=title, barmode="stack", height=700)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="seconds", row=3, col=1)
    return fig


def latency_histograms(requests: Sequence, title: str = "Request latencies") -> go.Figure:
    """Histograms (ms) of queue time, TTFT, TPOT, every ITL and e2e over the finished requests."""
    names = ("queue_time", "ttft", "tpot", "itl", "e2e")
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names)
    for col, name in enumerate(names, start=1):
        if name == "itl":
            values = [v for r in requests for v in r.itl]
        else:
            values = [getattr(r, name) for r in requests if getattr(r, name) is not None]
        fig.add_trace(go.Histogram(x=[v * 1e3 for v in values], name=name, showlegend=False), 1, col)
        fig.update_xaxes(title_text="ms", row=1, col=col)
    fig.update_layout(title=title, height=350)
    return fig
