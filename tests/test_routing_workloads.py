"""Imbalance workloads route exactly as designed; grouped dispatch matches the per-token reference on each."""
import pytest
import torch

from latentmoe_lab.analysis.imbalance import interleaved_medians, measure_workloads
from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.ops.routing import combine, permute, plan_dispatch, route_topk
from latentmoe_lab.routing_workloads import (WORKLOADS, dead_expert, hot_group, make_workload, one_hot_expert,
                                     rotating_hotspot, same_topk, uniform)

N, E, K = 50, 16, 4  # N * K not a multiple of E: shares differ by one


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_route_topk_picks_exactly_the_designed_experts(name):
    workload = make_workload(name, N, E, K, seed=3)
    weights, indices = route_topk(workload.logits, K)
    assert torch.equal(indices.sort(-1).values, workload.expected)
    assert (workload.expected[:, 1:] != workload.expected[:, :-1]).all()  # K distinct experts per token
    torch.testing.assert_close(weights.sum(-1), torch.ones(N))
    assert int(workload.counts.sum()) == N * K


def test_each_workload_has_its_designed_load():
    fair = N * K / E
    counts = uniform(N, E, K).counts
    assert counts.max() - counts.min() <= 1
    hot = one_hot_expert(N, E, K, hot=5).counts
    assert hot[5] == N and hot.max() == N
    group = hot_group(N, E, K, n_group=4, group=1).counts  # experts 4..7, 2 slots of 4 per token
    assert group[4:8].tolist() == [N * 2 // 4] * 4 and group[4:8].min() > group[torch.arange(E) // 4 != 1].max()
    dead = dead_expert(N, E, K, dead=9).counts
    assert dead[9] == 0 and dead[torch.arange(E) != 9].min() >= fair - 1
    same = same_topk(N, E, K).counts
    assert sorted(same.tolist())[-K:] == [N] * K and (same == 0).sum() == E - K


def test_rotating_hotspot_moves_the_hot_expert():
    workload = rotating_hotspot(N * 4, E, K, num_phases=4)
    assert workload.phase.unique().tolist() == [0, 1, 2, 3]
    for p in range(4):
        in_phase = workload.expected[workload.phase == p]
        per_expert = torch.bincount(in_phase.reshape(-1), minlength=E)
        assert per_expert.argmax() == p * E // 4 and per_expert.max() == len(in_phase)


@pytest.mark.parametrize("name", ["uniform", "dead_expert", "same_topk"])
def test_grouped_dispatch_matches_per_token_reference(name):
    torch.manual_seed(0)
    workload = make_workload(name, 9, 8, 2)  # same_topk leaves 6 experts empty, dead_expert one
    weights, indices = route_topk(workload.logits, 2)
    experts = LatentExperts(8, 16, 8)
    torch.nn.init.normal_(experts.w13, std=0.3)
    torch.nn.init.normal_(experts.w2, std=0.3)
    z = torch.randn(9, 16)
    plan = plan_dispatch(indices, 8)
    with torch.no_grad():
        grouped = combine(experts(permute(z, plan), plan.counts), weights, plan, 9)
        reference = torch.stack([sum(w * experts.expert_reference(z[n], int(e))
                                     for w, e in zip(weights[n], indices[n])) for n in range(9)])
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)


def test_measure_workloads_reports_load_and_time():
    workloads = [make_workload(name, 64, 8, 2) for name in ("uniform", "same_topk")]
    uniform_m, same_m = measure_workloads(workloads, latent_size=16, intermediate_size=16, repeats=1)
    assert uniform_m.stats.max_over_mean == 1.0 and uniform_m.padded_rows == uniform_m.rows == 128
    assert same_m.stats.max_over_mean == 4.0 and same_m.padded_rows == 8 * 64
    assert same_m.stats.dropped_fraction == pytest.approx((128 - 2 * 20) / 128)  # capacity ceil(1.25 * 16) = 20
    assert uniform_m.expert_seconds > 0 and same_m.phase_max_over_mean == [4.0]


@pytest.mark.parametrize("call,name", [
    (lambda: uniform(0, 8, 2), "num_tokens"),
    (lambda: uniform(4, 8, 8), "top_k"),
    (lambda: one_hot_expert(4, 8, 2, hot=8), "hot"),
    (lambda: hot_group(4, 8, 2, n_group=3), "n_group"),
    (lambda: hot_group(4, 8, 2, group=4, n_group=4), "group"),
    (lambda: dead_expert(4, 8, 2, dead=-1), "dead"),
    (lambda: rotating_hotspot(4, 8, 2, num_phases=9), "num_phases"),
    (lambda: make_workload("bursty", 4, 8, 2), "name"),
    (lambda: measure_workloads([]), "workloads"),
    (lambda: interleaved_medians({"f": lambda: None}, repeats=0), "repeats"),
])
def test_validation_names_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()
