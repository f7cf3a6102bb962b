"""The timelines of a disaggregated service's instances and the transfers between them (docs/design.md §13.2).

It takes records, not processes: per instance its engine's step records (serving.metrics.StepRecord), and the
router's TransferRecords, all on one monotonic clock.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def step_label(step) -> str:
    """What one step ran, for its hover text."""
    return (f"{step.prefill_chunks} prefill chunks ({step.prefill_tokens} tokens), {step.decode_tokens} decode tokens, "
            f"{step.duration * 1e3:.1f} ms; running {step.running}, waiting {step.waiting}, "
            f"blocks {step.blocks_used}")


def instances_timeline_figure(step_logs: Mapping[str, Sequence], transfers: Sequence, t0: float,
                              title: str = "Instances: steps over time and the transfers between them") -> go.Figure:
    """One row per instance: each step a bar as wide as it took ([end - duration, end]), its prefill and decode
    tokens stacked, the hover saying what it ran; a last row: each transfer a segment from export start on
    its prefill instance to import done on its decode instance (y: the request key), hover bytes and ms.
    x: seconds since t0 (the workload's start)."""
    names = list(step_logs)
    fig = make_subplots(rows=len(names) + 1, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=[f"{name}: tokens per step" for name in names] +
                        ["transfers (export start -> import done), by request"])
    for row, name in enumerate(names, start=1):
        steps = list(step_logs[name])
        x = [s.time - t0 for s in steps]
        widths = [s.duration for s in steps]
        offsets = [-w for w in widths]
        labels = [step_label(s) for s in steps]
        for kind, color in (("prefill", "#1f77b4"), ("decode", "#ff7f0e")):
            fig.add_trace(go.Bar(x=x, y=[getattr(s, f"{kind}_tokens") for s in steps], width=widths, offset=offsets,
                                 name=f"{name} {kind} tokens", marker_color=color, hovertext=labels), row, 1)
    xs, ys, hover = [], [], []
    for t in transfers:  # one segment each, None between them
        label = (f"request {t.key}: {t.source} -> {t.target}, {t.size:,} bytes ({t.prompt_tokens} prompt tokens), "
                 f"{t.seconds * 1e3:.1f} ms")
        xs += [t.start - t0, t.start + t.seconds - t0, None]
        ys += [t.key, t.key, None]
        hover += [label, label, None]
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name="transfers", hovertext=hover,
                             line_color="#2ca02c"), len(names) + 1, 1)
    fig.update_layout(title=title, barmode="stack", height=300 * len(names) + 300)
    fig.update_xaxes(title_text="seconds since the workload started", row=len(names) + 1, col=1)
    return fig
