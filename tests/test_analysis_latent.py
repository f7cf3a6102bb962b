"""Latent trade-offs and expert-parallel rank loads, computed from the config (docs/design.md §1.2)."""
import math

import pytest

from latentmoe_lab.analysis.latent import expert_parallel_ranks, iso_communication, latent_tradeoff
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT


@pytest.fixture(scope="module")
def full():
    return ModelConfig.from_preset("k3-2.8t")


def test_iso_communication_rule_of_the_full_config(full):
    rule = iso_communication(full)
    assert (rule["latent_top_k"], rule["latent_size"], rule["base_top_k"], rule["hidden_size"]) == (16, 3584, 8, 7168)
    assert rule["latent_product"] == rule["base_product"] == 16 * 3584 == 8 * 7168


def test_tradeoff_scales_by_alpha(full):
    points = latent_tradeoff(full, alphas=(1, 2, 4, 8), weight_format="fp8", payload_bits=16)
    assert [(p.latent_size, p.num_experts, p.top_k) for p in points] == [
        (7168, 448, 8), (3584, 896, 16), (1792, 1792, 32), (896, 3584, 64)]
    inter = full.moe.expert_intermediate_size
    for p in points:
        assert p.expert_bytes == pytest.approx(3 * p.latent_size * inter * BITS_PER_WEIGHT["fp8"] / 8)
        assert p.expert_bytes == pytest.approx(points[0].expert_bytes / p.alpha)  # one expert shrinks by alpha
        assert p.payload_bytes_per_token == points[0].payload_bytes_per_token == 8 * 7168 * 2  # iso-communication
        assert p.expert_flops_per_token == points[0].expert_flops_per_token
        assert p.routed_expert_bytes == pytest.approx(points[0].routed_expert_bytes)
    assert points[0].projection_flops_per_token == 0 and points[1].projection_flops_per_token == 4 * 7168 * 3584


def test_fixed_experts_shrink_payload_and_flops(full):
    points = latent_tradeoff(full, alphas=(1, 2, 4), iso_communication=False)
    assert {(p.num_experts, p.top_k) for p in points} == {(896, 16)}
    for p in points:
        assert p.payload_bytes_per_token == pytest.approx(points[0].payload_bytes_per_token / p.alpha)
        assert p.expert_flops_per_token * p.alpha == points[0].expert_flops_per_token


def test_expert_parallel_ranks_of_the_full_config(full):
    loads = expert_parallel_ranks(full, ep_sizes=(8, 64, 128), tokens_per_rank=1000, payload_bits=8)
    assert [r.experts_per_rank for r in loads] == [112, 14, 7]
    for r in loads:
        assert r.rows_per_rank == 16_000 and r.rows_per_expert == pytest.approx(16_000 * r.ep / 896)
        miss = math.comb(896 - 896 // r.ep, 16) / math.comb(896, 16)
        assert r.ranks_per_token == pytest.approx(r.ep * (1 - miss))
        assert r.send_bytes_per_copy == pytest.approx(1000 * 16 * (r.ep - 1) / r.ep * 3584)
        assert r.send_bytes_per_rank_dedup < r.send_bytes_per_copy
    assert loads[0].ranks_per_token < 8 < loads[2].ranks_per_token < 16  # 16 picks over 8 ranks collide often


@pytest.mark.parametrize("call,name,error", [
    (lambda c: latent_tradeoff(c, alphas=(3,)), "alphas", ValueError),
    (lambda c: latent_tradeoff(c, alphas=()), "alphas", ValueError),
    (lambda c: latent_tradeoff(c, weight_format="int3"), "weight_format", ValueError),
    (lambda c: latent_tradeoff(c, payload_bits=0), "payload_bits", ValueError),
    (lambda c: expert_parallel_ranks(c, ep_sizes=(3,)), "ep_sizes", ValueError),
    (lambda c: expert_parallel_ranks(c, tokens_per_rank=0), "tokens_per_rank", ValueError),
    (lambda c: latent_tradeoff("k3"), "config", TypeError),
])
def test_validation_names_the_argument(full, call, name, error):
    with pytest.raises(error, match=f"^{name}:"):
        call(full)
