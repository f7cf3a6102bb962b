"""viz.attention: every builder returns a figure with the traces it promises."""
import math

import plotly.graph_objects as go
import torch

from latentmoe_lab.analysis.attention_cost import hybrid_cost, ratio_table
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.viz import attention as viz


def test_state_decay_and_equality_figures():
    states = torch.randn(5, 4, 3)
    states[0] = 0.01  # a nearly empty first step, as after one write
    states[3] *= 10
    fig = viz.kda_state_steps_figure(states)
    assert len(fig.data) == 5 and len(fig.layout.sliders[0].steps) == 5
    assert [trace.visible for trace in fig.data] == [False, False, False, True, False]  # opens on the fullest
    assert fig.layout.sliders[0].active == 3 and fig.layout.xaxis.dtick == 1 and fig.layout.yaxis.dtick == 1
    fig = viz.decay_gates_figure({"a": torch.rand(6, 4), "b": torch.rand(6, 4)})
    assert len(fig.data) == 2
    reference = torch.randn(2, 9, 3)
    fig = viz.chunked_vs_recurrent_figure(reference, reference + 1e-7)
    assert isinstance(fig, go.Figure) and "max |diff|" in fig.layout.title.text


def test_topk_pattern_marks_every_selected_position():
    selected = torch.tensor([[0, -1], [1, 0], [2, 0]])
    fig = viz.topk_pattern_figure(torch.randn(3, 3), selected)
    heatmap, dots = fig.data
    assert sorted(zip(dots.y, dots.x)) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 2)]
    assert math.isnan(heatmap.z[0][1])  # keys after the query are not shown


def test_cost_ratio_breakdown_and_recall_figures():
    full = ModelConfig.from_preset("k3-2.8t")
    assert len(viz.cost_curves_figure([1, 2], {"a": [1, 2], "b": [3, 4]}, "bytes", "t").data) == 2
    rows = ratio_table(full, [4096, 8192], [1, 3, math.inf])
    assert len(viz.hybrid_ratio_figure(rows).data) == 3 * 2 + 2  # two panels per ratio, dense reference in both
    fig = viz.hybrid_breakdown_figure(hybrid_cost(full, 4096, 3))
    assert "3:1 KDA:DSA at 4,096" in fig.layout.title.text and len(fig.data) == 6
    assert len(viz.recall_curve_figure([0, 1], [0.5, 0.6], [1.0, 0.8]).data) == 2


def test_equality_scatter_is_sampled_but_reports_the_worst_difference():
    reference = torch.zeros(10_000)
    chunked = reference.clone()
    chunked[7] = 0.5  # not in the sample of every 3rd element
    fig = viz.chunked_vs_recurrent_figure(reference, chunked, max_points=4000)
    assert len(fig.data[0].x) <= 4000 and "5.0e-01" in fig.layout.title.text
