"""Figures of a language-model training run: loss curves and expert load over steps."""
from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go


def loss_curves_figure(train_loss: Sequence[float], eval_rows: Sequence[Sequence[float]],
                       title: str = "Loss (bits per byte)") -> go.Figure:
    """Training CE per step and held-out CE at each evaluation, both in bits per byte (nats / ln 2).

    train_loss [steps] in nats; eval_rows [[step, loss in nats, bits per byte], ...].
    """
    steps = list(range(1, len(train_loss) + 1))
    fig = go.Figure([
        go.Scatter(x=steps, y=[loss / math.log(2) for loss in train_loss], mode="lines", name="train"),
        go.Scatter(x=[row[0] for row in eval_rows], y=[row[2] for row in eval_rows], mode="lines+markers",
                   name="held-out"),
    ])
    fig.add_hline(y=8.0, line_dash="dot", annotation_text="uniform over bytes (8 bits)")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="bits per byte")
    return fig


def expert_load_over_steps_figure(expert_load: Sequence[Sequence], layer_labels: Sequence[str],
                                  title: str = "Expert load imbalance over training (max / mean)") -> go.Figure:
    """Heatmap [MoE layer, step] of the busiest expert's load over the mean load (1.0 = perfect balance).

    expert_load: [[step, [max/mean for each MoE layer]], ...] as trainer_state.json stores it.
    """
    steps = [row[0] for row in expert_load]
    z = [[row[1][layer] for row in expert_load] for layer in range(len(layer_labels))]
    fig = go.Figure(go.Heatmap(x=steps, y=list(layer_labels), z=z, colorscale="Viridis", zmin=1.0,
                               colorbar_title="max / mean"))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="MoE layer")
    return fig
