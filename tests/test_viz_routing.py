"""Routing figures build from plain numbers and show what they claim."""
import torch

from latentmoe_lab.analysis.latent import expert_parallel_ranks, latent_tradeoff
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.viz import routing as viz


def test_scores_and_group_figures_mark_the_picks():
    fig = viz.router_scores_figure(torch.rand(3, 8), torch.tensor([[0, 1], [2, 3], [7, 6]]))
    assert list(fig.data[1].x) == [0, 1, 2, 3, 7, 6] and list(fig.data[1].y) == [0, 0, 1, 1, 2, 2]
    fig = viz.group_limit_figure(torch.arange(8.0), n_group=4, kept_groups=[3, 1], selected=[7, 6])
    by_name = {trace.name: list(trace.x) for trace in fig.data}
    assert by_name == {"picked": [6, 7], "eligible": [2, 3], "masked (-inf)": [0, 1, 4, 5]}


def test_workload_and_balancing_figures():
    fig = viz.workload_load_figure({"uniform": [2, 2, 2, 2], "hot": [5, 1, 1, 1]})
    assert fig.data[0].z[1][0] == 2.5
    fig = viz.workload_summary_figure(["a", "b"], [1.0, 8.0], [3.0, 4.0], [1.0, 8.0])
    assert len(fig.data) == 3
    fig = viz.balancing_figure({"none": [4, 4], "bias": [4, 2]}, {"none": [5, 4], "bias": [5, 4]})
    assert [t.name for t in fig.data] == ["none", "none", "bias", "bias"]
    assert len(viz.balancing_figure({"aux": [2, 1]}).data) == 1


def test_latent_and_ep_figures_from_the_full_config():
    config = ModelConfig.from_preset("k3-2.8t")
    fig = viz.latent_tradeoff_figure(latent_tradeoff(config), selected_alpha=4)
    assert len(fig.data) == 4 and [t.opacity for t in fig.data] == [0.3, 0.3, 1.0, 0.3]
    assert list(fig.data[2].y)[:2] == [4.0, 4.0]  # alpha 4: 4x the experts and 4x the top-k of alpha 1
    fig = viz.ep_ranks_figure(expert_parallel_ranks(config))
    assert list(fig.data[0].x) == ["EP=8", "EP=64", "EP=128"]
