"""Layout rules, mesh coordinates, stage partition, schedules and TP slicing, all in one process."""
import pytest
import torch

from latentmoe_lab.cache import KDALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.mesh import all_lines, coords_rank, data_shard, line_members, rank_coords
from latentmoe_lab.parallel.pipeline import (gpipe_schedule, layer_costs, one_f_one_b_schedule, partition_layers,
                                             peak_live_micro_batches, simulate_schedule, stage_costs)
from latentmoe_lab.parallel.tensor import shard_dsa, shard_experts, shard_kda, shard_swiglu, split


# ----------------------------------------------------------------------------- invalid layouts
@pytest.mark.parametrize("kwargs, message", [
    (dict(ep=3), "ep: 3 must divide moe.num_experts"),
    (dict(tp=4), "tp: 4 must divide kda.num_heads"),
    (dict(pp=5), "pp: 5 stages need at least one layer each"),
])
def test_layouts_that_do_not_divide_the_model_are_refused(tiny_config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs).validate_for(tiny_config)


def test_world_size_batch_and_sequence_rules():
    layout = ParallelConfig(ep=2, tp=2)
    with pytest.raises(ValueError, match="needs 4 processes"):
        layout.validate_for(ModelConfig.from_preset("tiny"), world_size=2)
    with pytest.raises(ValueError, match="batch 3 must be divisible by dp\\*ep = 2"):
        layout.validate_batch(3, 8)
    with pytest.raises(ValueError, match="divisible by cp = 2"):
        ParallelConfig(cp=2).validate_batch(2, 7)
    with pytest.raises(ValueError, match="micro_batches: 3 must divide"):
        ParallelConfig(pp=2, micro_batches=3).validate_batch(4, 8)
    with pytest.raises(ValueError, match="per-rank sequence 3 must be divisible by tp = 2"):
        ParallelConfig(tp=2, sequence_parallel=True).validate_batch(2, 3)


@pytest.mark.parametrize("kwargs", [dict(ep=0), dict(tp=-1), dict(pp=1.5), dict(schedule="zigzag"),
                                    dict(timeout_s=0)])
def test_bad_sizes_and_options_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ParallelConfig(**kwargs)


def test_layout_strings_parse_and_bad_ones_are_refused():
    p = ParallelConfig.from_layout("TP8xPP4xEP8xDP2")
    assert (p.tp, p.pp, p.ep, p.dp, p.world_size) == (8, 4, 8, 2, 512)
    assert ParallelConfig.from_layout("EP64 x TP8 x PP4").world_size == 2048
    assert p.name() == "EP8xTP8xPP4xDP2"
    for bad in ("EP64xQQ8", "EP2xEP2", ""):
        with pytest.raises(ValueError, match="layout"):
            ParallelConfig.from_layout(bad)
    ParallelConfig.from_layout("EP64xTP8xPP4").validate_for(ModelConfig.from_preset("k3-2.8t"))


# ----------------------------------------------------------------------------- mesh coordinates
def test_rank_coordinates_round_trip_and_lines():
    p = ParallelConfig(pp=2, ep=2, tp=2)
    for rank in range(p.world_size):
        assert coords_rank(p, rank_coords(p, rank)) == rank
    assert rank_coords(p, 5) == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert line_members(p, "tp", 5) == [4, 5]
    assert line_members(p, "ep", 5) == [5, 7]
    assert line_members(p, "pp", 5) == [1, 5]
    assert sorted(r for line in all_lines(p, "ep") for r in line) == list(range(8))
    assert [data_shard(p, r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="rank"):
        rank_coords(p, 8)


# ----------------------------------------------------------------------------- pipeline stages
def test_partition_is_contiguous_and_minimises_the_largest_stage():
    config = ModelConfig.from_preset("k3-2.8t")
    stages = partition_layers(config, 4)
    assert [s.start for s in stages][0] == 0 and stages[-1].stop == 93
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    costs = stage_costs(config, stages)
    per_layer = layer_costs(config)
    # moving one boundary layer either way never lowers the maximum
    for i in range(3):
        for shift in (-1, 1):
            bounds = [s.stop for s in stages[:-1]]
            bounds[i] += shift
            cut = [0] + bounds + [93]
            moved = [sum(per_layer[a:b]) for a, b in zip(cut, cut[1:])]
            moved[-1] += config.hidden_size * config.vocab_size
            assert max(moved) >= max(costs)
    with pytest.raises(ValueError, match="pp"):
        partition_layers(config, 94)


def test_schedules_order_and_live_micro_batches():
    assert gpipe_schedule(3, 2, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert one_f_one_b_schedule(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                             ("B", 2), ("B", 3)]
    assert peak_live_micro_batches(gpipe_schedule(8, 4, 0)) == 8
    assert peak_live_micro_batches(one_f_one_b_schedule(8, 4, 0)) == 4
    assert peak_live_micro_batches(one_f_one_b_schedule(8, 4, 3)) == 1
    for schedule in ("gpipe", "1f1b"):
        events = simulate_schedule(schedule, 6, 3)
        span = max(e["end"] for e in events)
        busy = sum(e["end"] - e["start"] for e in events)
        assert abs((1 - busy / (3 * span)) - 2 / (6 + 2)) < 1e-9  # bubble (p-1)/(m+p-1)


# ----------------------------------------------------------------------------- TP slicing math
def test_split_takes_the_same_slice_of_every_block():
    t = torch.arange(12.0)
    assert split(t, 0, 1, 2, [4, 4, 4]).tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="tp: 3 must divide"):
        split(t, 0, 0, 3, [4, 8])


def test_kda_head_shards_sum_to_the_full_layer_with_cache(tiny_config):
    full = KimiDeltaAttention(tiny_config)
    x, step = torch.randn(2, 19, tiny_config.hidden_size), torch.randn(2, 1, tiny_config.hidden_size)
    full_cache = KDALayerCache()
    expected = torch.cat([full(x, full_cache), full(step, full_cache)], dim=1)
    total = 0
    for rank in range(2):
        shard, cache = shard_kda(full, tiny_config, rank, 2), KDALayerCache()
        total = total + torch.cat([shard(x, cache), shard(step, cache)], dim=1)
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5)


def test_dsa_head_shards_sum_to_the_full_layer(tiny_config):
    full = GatedDSA(tiny_config)
    x = torch.randn(2, 40, tiny_config.hidden_size)  # longer than the index top-k: truly sparse
    total = shard_dsa(full, tiny_config, 0, 2)(x) + shard_dsa(full, tiny_config, 1, 2)(x)
    torch.testing.assert_close(total, full(x), atol=1e-6, rtol=1e-5)


def test_ffn_and_expert_width_shards_sum_to_the_full_modules():
    ffn = SwiGLU(16, 32)
    x = torch.randn(5, 16)
    torch.testing.assert_close(shard_swiglu(ffn, 0, 2)(x) + shard_swiglu(ffn, 1, 2)(x), ffn(x))
    experts = LatentExperts(4, 16, 32)
    torch.nn.init.normal_(experts.w13, std=0.2)
    torch.nn.init.normal_(experts.w2, std=0.2)
    counts = torch.tensor([3, 0, 2, 4])
    z = torch.randn(int(counts.sum()), 16)
    expected = experts(z, counts)
    rows = 0
    for first in (0, 2):  # two EP shards of two experts, each split over two TP ranks
        local_counts = counts[first:first + 2]
        z_local = z[rows:rows + int(local_counts.sum())]
        partial = sum(shard_experts(experts, first, 2, r, 2)(z_local, local_counts) for r in range(2))
        torch.testing.assert_close(partial, expected[rows:rows + len(z_local)], atol=1e-6, rtol=1e-5)
        rows += len(z_local)
    with pytest.raises(ValueError, match="first, count"):
        shard_experts(experts, 3, 2, 0, 1)
