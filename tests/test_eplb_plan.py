"""The balancer on paper (parallel/eplb/plan.py) and the planner's redundant expert slots."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.plan import plan_placement, workload_loads
from latentmoe_lab.parallel.hardware import HARDWARE, SERVE_128K
from latentmoe_lab.parallel.planner import plan_layout


@pytest.fixture(scope="module")
def k3():
    return ModelConfig.from_preset("k3-2.8t")


def test_k3_ep64_with_32_redundant_slots_holds_one_more_expert_per_layer(k3):
    pconfig, hardware = ParallelConfig(ep=64), HARDWARE["H200-141GB"]
    base = plan_layout(k3, pconfig, hardware, SERVE_128K)
    extra = plan_layout(k3, pconfig, hardware, SERVE_128K, redundant_experts=32)
    moe = k3.moe
    moe_layers = sum(k3.is_moe_layer(i) for i in range(k3.num_layers))
    # 896 + 32 slots over 64 ranks: the fullest rank holds 15 instead of 14 in every MoE layer
    expert_bytes = 3 * moe.latent_size * moe.expert_intermediate_size * BITS_PER_WEIGHT[SERVE_128K.expert_format] / 8
    assert extra.memory.weights - base.memory.weights == pytest.approx(moe_layers * expert_bytes)
    with pytest.raises(ValueError, match="^redundant_experts:"):
        plan_layout(k3, pconfig, hardware, SERVE_128K, redundant_experts=-1)


def test_busiest_rank_sets_the_step_time_and_the_balancer_shortens_it(k3):
    pconfig, hardware = ParallelConfig(ep=64), HARDWARE["H200-141GB"]
    moe_layers = sum(k3.is_moe_layer(i) for i in range(k3.num_layers))
    weight = workload_loads("one_hot_expert", moe_layers, k3.moe.num_experts, k3.moe.top_k, num_tokens=1024)
    before = plan_placement(k3, pconfig, hardware, SERVE_128K, weight, None)
    after = plan_placement(k3, pconfig, hardware, SERVE_128K, weight, 64)
    even = plan_layout(k3, pconfig, hardware, SERVE_128K)
    assert before.balancedness < 0.3 and after.balancedness >= 0.9  # one slot per rank is enough here
    prefill = [s.plan.times["prefill"]["sequential"] for s in (before, after)]
    assert prefill[0] > prefill[1] >= even.times["prefill"]["sequential"] * 0.999
    with pytest.raises(ValueError, match="^weight:"):
        plan_placement(k3, pconfig, hardware, SERVE_128K, weight[:3], 64)


def test_workload_loads_shuffle_experts_per_layer():
    loads = workload_loads("one_hot_expert", 3, 16, 2, num_tokens=64)
    assert torch.equal(loads.sum(1), torch.full((3,), 128.0))
    assert len({int(row.argmax()) for row in loads}) > 1  # the hot expert moves between layers
