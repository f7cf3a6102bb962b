"""The planner at full scale, the byte model's pieces, and big-model offload with accelerate."""
import itertools

import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import HARDWARE, SERVE_128K, Workload
from latentmoe_lab.parallel.offload import (ExpertCache, dispatch_with_offload, full_scale_device_map,
                                            offload_experts)
from latentmoe_lab.parallel.planner import EXAMPLE_LAYOUTS, plan_examples, plan_layout, plan_table
from latentmoe_lab.parallel.traffic import a2a_rows, forward_traffic, hit_probability, moe_a2a_bytes


@pytest.fixture(scope="module")
def k3():
    return ModelConfig.from_preset("k3-2.8t")


def test_example_layouts_and_which_fit(k3):
    sizes = [p.world_size for p, _ in EXAMPLE_LAYOUTS.values()]
    assert sizes == [2048, 512, 128]
    h100 = plan_examples(k3, HARDWARE["H100-80GB"])
    assert [p.fits for p in h100] == [True, False, False]
    assert "optimizer" in h100[1].reason and "does not fit" in h100[1].reason  # Adam states at 512 devices
    assert h100[2].memory.kv_state > 0 and h100[2].memory.grads == 0  # serving holds caches, no grads
    h200 = plan_examples(k3, HARDWARE["H200-141GB"])
    assert h200[2].fits and "fits" in h200[2].reason
    table = plan_table(h100)
    assert "EP64xTP8xPP4" in table and "NO" in table
    # every device of the 2048 layout holds 14 experts per layer at 1/8 of their width
    first = h100[0]
    assert sum(len(s) for s in first.stages) == 93 and len(first.stages) == 4
    for plan in h100:
        for phase in ("prefill", "decode"):
            t = plan.times[phase]
            assert 0 < t["overlapped"] <= t["shared_overlap"] <= t["sequential"]


def test_weights_shrink_with_each_split(k3):
    train = EXAMPLE_LAYOUTS["EP64xTP8xPP4 = 2048 (training)"][1]
    base = plan_layout(k3, ParallelConfig(ep=8, tp=8, pp=4), HARDWARE["H100-80GB"], train).memory.weights
    for bigger in (dict(ep=16, tp=8, pp=4), dict(ep=8, tp=8, pp=8)):
        assert plan_layout(k3, ParallelConfig(**bigger), HARDWARE["H100-80GB"], train).memory.weights < base


def test_hit_probability_matches_enumeration():
    experts, top_k, ep = 8, 2, 4
    per_rank = experts // ep
    hits = [any(e // per_rank == 0 for e in pair) for pair in itertools.combinations(range(experts), top_k)]
    assert hit_probability(experts, top_k, ep) == pytest.approx(sum(hits) / len(hits))


def test_grouping_and_latent_shrink_the_all_to_all(k3):
    sizes = moe_a2a_bytes(k3, 64, tokens=4096)
    assert sizes["grouped_latent"] < sizes["pairs_latent"] < sizes["pairs_hidden"]
    assert sizes["grouped_latent"] < sizes["grouped_hidden"]
    assert sizes["pairs_latent"] / sizes["pairs_hidden"] == pytest.approx(3584 / 7168)
    assert moe_a2a_bytes(k3, 1, tokens=4096)["grouped_latent"] == 0


def test_a2a_rows_count_one_row_per_token_and_destination(tiny_config):
    layout = ParallelConfig(ep=2, dp=2)
    routing = torch.tensor([[0, 1], [0, 4], [5, 6], [7, 2]] * 4)  # 4 rows x 4 tokens, experts 0-3 on ep 0
    # rank 0 (dp 0, ep 0) holds rows 0; rank 1 (dp 0, ep 1) rows 1; each row has tokens 0..3
    out, into = a2a_rows(routing, layout, tiny_config, batch=4, seq_len=4, rank=0)
    assert (out, into) == (3, 3)  # tokens 1 and 3 hit rank 1 (plus token 2), from rank 1 likewise


def test_forward_traffic_expected_and_shape_only_parts(tiny_config):
    tp = forward_traffic(tiny_config, ParallelConfig(tp=2), batch=2, seq_len=8, act_bytes=4)
    # per layer: attention all-reduce; layer 0 dense, layers 1-3 MoE (fp32 expert sum + shared)
    tokens = 2 * 8
    assert tp[0]["tp.attn"] == 4 * tokens * 64 * 4
    assert tp[0]["tp.dense"] == tokens * 64 * 4
    assert tp[0]["tp.moe_routed"] == 3 * tokens * 32 * 4
    expected = forward_traffic(tiny_config, ParallelConfig(ep=2), batch=2, seq_len=8)
    assert expected[0]["ep.tokens"] == pytest.approx(3 * 8 * hit_probability(8, 2, 2) * 32 * 2)


def test_hardware_and_workload_checks(k3):
    with pytest.raises(ValueError, match="mode"):
        Workload(mode="fly")
    with pytest.raises(ValueError, match="expert_format"):
        Workload(expert_format="int3")
    with pytest.raises(ValueError, match="ep: 5 must divide"):
        plan_layout(k3, ParallelConfig(ep=5), HARDWARE["H100-80GB"], SERVE_128K)


# ----------------------------------------------------------------------------- accelerate offload
def test_expert_cache_policies():
    lru, lfu = ExpertCache(2, "lru"), ExpertCache(2, "lfu")
    for key in ["a", "a", "b", "c", "a"]:
        lru.get(key, lambda k=key: k)
        lfu.get(key, lambda k=key: k)
    assert list(lru.entries) == ["c", "a"] and (lru.hits, lru.misses) == (1, 4)
    assert set(lfu.entries) == {"a", "c"} and (lfu.hits, lfu.misses) == (2, 3)
    assert lfu.hit_rate == pytest.approx(0.4)
    with pytest.raises(ValueError, match="policy"):
        ExpertCache(2, "fifo")


def test_offloaded_model_keeps_its_logits(tiny_config, tmp_path):
    model = LatentMoEForCausalLM(tiny_config).eval()
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24))
    with torch.no_grad():
        expected = model(ids).logits
    # 8 experts per layer: 2 stay resident, the 6 cold ones fit the cache once loaded
    layers = offload_experts(model, tmp_path / "experts", hot=2, capacity=6, policy="lru", calibration=ids[:, :8])
    device_map = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "cpu", "layers.2": "disk",
                  "layers.3": "disk", "norm": "cpu", "lm_head": "cpu", "vision": "cpu"}
    model = dispatch_with_offload(model, device_map, tmp_path / "blocks")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
        model(ids)  # the same tokens again: cold experts now come from the cache
    assert sorted(layers) == [1, 2, 3]
    for experts in layers.values():
        assert len(experts.hot) == 2 and experts.bytes_read > 0
        assert experts.cache.hits == experts.cache.misses  # second pass: every cold expert was cached


def test_full_scale_device_map_spills_to_cpu_and_disk(k3):
    max_memory = {0: 141 * 10**9, 1: 141 * 10**9, "cpu": 2 * 10**12, "disk": 10**14}
    device_map = full_scale_device_map(k3, max_memory)
    placed = set(device_map.values())
    assert {0, 1, "cpu", "disk"} <= placed
    assert device_map["embed_tokens"] == 0 and device_map["lm_head"] == "disk"


def test_parallel_figures_build_from_plans_and_runs(k3):
    from latentmoe_lab.parallel.pipeline import simulate_schedule
    from latentmoe_lab.viz import parallel as viz

    plans = plan_examples(k3, HARDWARE["H100-80GB"])
    names = [p.name for p in plans]
    figures = [viz.memory_figure(names, [p.memory.as_dict() for p in plans], HARDWARE["H100-80GB"].usable_bytes),
               viz.step_time_figure(names, [p.times for p in plans], "decode"),
               viz.a2a_variants_figure(names, [p.traffic for p in plans]),
               viz.pipeline_schedule_figure(simulate_schedule("1f1b", 4, 2)),
               viz.stage_balance_figure([1.0, 2.0]),
               viz.traffic_matrix_figure([{1: 10}, {0: 7}]),
               viz.measured_vs_planned_figure({"ep.tokens": 5}, {"ep.tokens": 5}),
               viz.holdings_figure([{"rank": 0, "coords": {"ep": 0}, "layers": [0, 1], "experts": [0]}], 2, 2)]
    assert all(len(f.data) >= 1 for f in figures)
    assert len(figures[0].data) == 5  # weights, grads, optimizer, kv_state, activations
