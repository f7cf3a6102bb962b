"""The expert-parallel load balancer (parallel/eplb/rebalance.py) and its metrics (parallel/eplb/load.py)."""
import pytest
import torch

from latentmoe_lab.parallel.eplb.load import balance_metrics, rank_loads
from latentmoe_lab.parallel.eplb.plan import workload_loads
from latentmoe_lab.parallel.eplb.rebalance import (balanced_packing, default_placement, rebalance_experts,
                                                   replicate_experts)
from latentmoe_lab.routing_workloads import WORKLOADS, make_workload

# The public load balancer's documented example: two layers of 12 experts, 16 slots, 4 groups, 2 nodes, 8 ranks.
EXAMPLE_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
EXAMPLE_PHY2LOG = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


@pytest.mark.parametrize("refine", [False, True])
def test_documented_example_reproduced_exactly(refine):
    phy2log, log2phy, logcnt = rebalance_experts(EXAMPLE_WEIGHT, 16, 4, 2, 8, refine=refine)
    assert torch.equal(phy2log, EXAMPLE_PHY2LOG)
    assert torch.equal(logcnt, torch.stack([torch.bincount(row, minlength=12) for row in EXAMPLE_PHY2LOG]))
    assert log2phy.shape == (2, 12, 5)  # at most 16 - 12 + 1 replicas per expert
    assert log2phy[0, 5].tolist() == [0, 2, -1, -1, -1]  # expert 5 of layer 0 sits in slots 0 and 2


def _check_placement(phy2log, log2phy, logcnt, num_experts, num_replicas, num_ranks):
    layers = phy2log.shape[0]
    assert phy2log.shape == (layers, num_replicas) and logcnt.shape == (layers, num_experts)
    assert (logcnt >= 1).all() and (logcnt.sum(1) == num_replicas).all()
    assert num_replicas % num_ranks == 0  # every rank holds num_replicas / num_ranks slots
    for layer in range(layers):
        assert torch.equal(torch.bincount(phy2log[layer], minlength=num_experts), logcnt[layer])
        for expert in range(num_experts):
            slots = log2phy[layer, expert]
            real = slots[slots >= 0]
            assert len(real) == logcnt[layer, expert]  # -1 only pads
            assert (slots[len(real):] == -1).all()
            assert (phy2log[layer, real] == expert).all()  # log2phy and phy2log are inverse


@pytest.mark.parametrize("refine", [False, True])
@pytest.mark.parametrize("groups,nodes", [(4, 2), (3, 2), (1, 1)])
def test_placement_invariants_both_policies(groups, nodes, refine):
    weight = torch.distributions.Pareto(1.0, 1.2).sample((3, 24))
    weight[0, :4] = 50.0  # four equally hot experts: the case the refinement changes
    placement = rebalance_experts(weight, 32, groups, nodes, 8, refine=refine)
    _check_placement(*placement, num_experts=24, num_replicas=32, num_ranks=8)


def test_hierarchical_keeps_each_group_on_one_node():
    weight = torch.distributions.Pareto(1.0, 1.2).sample((2, 24))
    phy2log, _, _ = rebalance_experts(weight, 32, 4, 2, 8)  # 6 experts per group, 16 slots per node
    for row in phy2log:
        for node_slots in row.view(2, 16):
            groups_here = set((node_slots // 6).tolist())
            assert len(groups_here) == 2  # two whole groups per node, their replicas with them


def test_building_blocks():
    pack, place = balanced_packing(torch.tensor([[5.0, 1.0, 4.0, 2.0]]), 2)
    assert pack.tolist() == [[0, 0, 1, 1]] and place.tolist() == [[0, 1, 0, 1]]  # 5, 4, then 2 on 4, 1 on 5
    slot2item, replica, count = replicate_experts(torch.tensor([[9.0, 1.0, 4.0]]), 5)
    assert slot2item.tolist() == [[0, 1, 2, 0, 0]]  # 9 -> 4.5 (still the largest) -> 3
    assert replica.tolist() == [[0, 0, 0, 1, 2]] and count.tolist() == [[3, 1, 1]]


@pytest.mark.parametrize("args,name", [
    ((EXAMPLE_WEIGHT, 18, 4, 2, 8), "num_replicas"),    # not divisible by the ranks
    ((EXAMPLE_WEIGHT, 8, 4, 2, 8), "num_replicas"),     # fewer replicas than experts
    ((EXAMPLE_WEIGHT, 16, 5, 2, 8), "num_groups"),      # groups do not divide the experts
    ((EXAMPLE_WEIGHT, 16, 4, 3, 8), "num_nodes"),       # nodes do not divide the ranks
    ((EXAMPLE_WEIGHT[0], 16, 4, 2, 8), "weight"),
    ((-EXAMPLE_WEIGHT, 16, 4, 2, 8), "weight"),
    ((EXAMPLE_WEIGHT, 16, 4, 2, 0), "num_ranks"),
    ((EXAMPLE_WEIGHT, 16, 4, 2, 8, "yes"), "refine"),
    ((EXAMPLE_WEIGHT, 104, 4, 2, 8), "num_replicas"),   # more than one replica of each expert per rank (96)
    ((EXAMPLE_WEIGHT, 10 ** 6, 4, 2, 8), "num_replicas"),  # once ran for minutes: refused at once
])
def test_bad_input_names_the_argument(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        rebalance_experts(*args)


def test_huge_finite_float64_loads_are_balanced_not_refused():
    # checked in their own dtype: 1e300 is finite in float64 (a float32 cast made it inf and refused it)
    phy2log, _, logcnt = rebalance_experts(EXAMPLE_WEIGHT.double() * 1e298, 16, 4, 2, 8)
    assert torch.equal(phy2log, EXAMPLE_PHY2LOG) and (logcnt.sum(-1) == 16).all()


def test_metrics_reduce_over_ranks_not_layers():
    # layer 0 perfectly even, layer 1 one rank doing everything: per-layer values, then the mean
    load = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 0.0, 0.0]])
    metrics = balance_metrics(load)
    assert metrics["balancedness_per_layer"].tolist() == [1.0, 0.25]
    assert metrics["imbalance_per_layer"].tolist() == [0.0, 3.0]
    assert metrics["balancedness"] == pytest.approx(0.625) and metrics["imbalance"] == pytest.approx(1.5)
    # reducing over layers (columns) would give 4 values, and a different mean
    assert balance_metrics(torch.zeros(1, 4))["balancedness"] == 1.0


def test_rank_loads_split_replicas_evenly():
    weight = torch.tensor([[6.0, 2.0, 2.0, 2.0]])
    phy2log = torch.tensor([[0, 1, 0, 2, 0, 3]])  # expert 0 three times: 2 tokens per replica
    load = rank_loads(weight, phy2log, torch.tensor([[3, 1, 1, 1]]), 3)
    assert load.tolist() == [[4.0, 4.0, 4.0]]


def _balancedness(weight, placement, ranks):
    phy2log, _, logcnt = placement
    return balance_metrics(rank_loads(weight, phy2log, logcnt, ranks))["balancedness"]


def _before_after(weight, redundant, ranks):
    layers, experts = weight.shape
    def balancedness(placement):
        return _balancedness(weight, placement, ranks)

    before = balancedness(default_placement(layers, experts))  # expert e in slot e, contiguous ranges
    greedy = balancedness(rebalance_experts(weight, experts, 1, 1, ranks))  # packing alone, no redundant slot
    after = balancedness(rebalance_experts(weight, experts + redundant, 1, 1, ranks))
    return before, greedy, after


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_skewed_workloads_improve(name):
    counts = torch.stack([make_workload(name, 512, 64, 4, seed=s).counts for s in range(2)]).double()
    before, greedy, after = _before_after(counts, redundant=8, ranks=8)
    assert after >= before - 1e-12 and after >= greedy - 1e-12


def test_zipf_and_pareto_improve():
    ranks = torch.arange(1, 65, dtype=torch.float64)
    zipf = (1.0 / ranks)[torch.randperm(64)].repeat(2, 1)
    pareto = torch.distributions.Pareto(1.0, 1.1).sample((2, 64)).double()
    for weight in (zipf, pareto):
        before, greedy, after = _before_after(weight, redundant=8, ranks=8)
        assert after >= greedy >= before
        assert after > before


def _plain_and_refined(weight, num_slots, groups, nodes, ranks):
    return [_balancedness(weight, rebalance_experts(weight, num_slots, groups, nodes, ranks, refine=refine), ranks)
            for refine in (False, True)]


def test_refinement_never_worse_on_skewed_loads():
    rank_ids = torch.arange(1, 65, dtype=torch.float64)
    loads = [torch.stack([make_workload(name, 512, 64, 4, seed=s).counts for s in range(2)]).double()
             for name in sorted(WORKLOADS)]
    loads += [(1.0 / rank_ids)[torch.randperm(64)].repeat(2, 1),
              torch.distributions.Pareto(1.0, 1.1).sample((2, 64)).double()]
    for weight in loads:
        for groups, nodes in ((1, 1), (8, 2)):  # global and hierarchical
            plain, refined = _plain_and_refined(weight, 72, groups, nodes, 8)
            assert refined >= plain - 1e-12


def test_refinement_balances_same_topk_at_k3_scale():
    # 896 experts, EP64 + 64 redundant slots: the 16 hot experts need 4 replicas each, one per rank;
    # the public greedy gives them 5 (80 hot replicas, 16 ranks with two): balancedness 0.625
    weight = workload_loads("same_topk", 2, 896, 16)
    plain, refined = _plain_and_refined(weight, 960, 1, 8, 64)
    assert plain == pytest.approx(0.625)
    assert refined >= 0.9
