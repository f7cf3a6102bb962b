"""The layout planner (parallel/planner.py) with dsa.index_share_every = 2, against the real modules and pools.

A DSA layer that reuses another layer's top-k selection has no indexer weights and no index-key cache
(docs/design.md §15.2): the planner's parameters per stage must be the meta-device model's, and its
kv_state per stage the bytes PagedPools really allocates for the same layers.
"""
import pytest
import torch

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.meta import build_meta_model
from latentmoe_lab.paged_pools import DSAPool, PagedPools
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import Workload
from latentmoe_lab.parallel.planner import device_memory, stage_parameters
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat

BLOCKS, BLOCK_SIZE = 6, 16


def _config(share: int) -> ModelConfig:
    # DSA at layers 3 and 7: with share 2, layer 7 replays layer 3's selection (pp=2 keeps them on one stage)
    return ModelConfig.from_preset("tiny").replace(num_layers=8, dsa={"index_share_every": share})


# the second case: DSA at 1, 3, 5, 7; layers 3 and 7 reuse the selections of 1 and 5
@pytest.fixture(params=[dict(), dict(dsa_interval=2, layer_types=None)], ids=["dsa-3-7", "dsa-1-3-5-7"])
def shared(request):
    config = _config(2).replace(**request.param)
    reusers = [i for i, kind in enumerate(config.layer_types) if kind == DSA and config.index_source(i) != i]
    assert reusers  # the case under test: at least one DSA layer without an indexer
    return config, reusers


def test_stage_parameters_equal_the_meta_model_with_shared_indexers(shared):
    config, reusers = shared
    model = build_meta_model(config)
    assert all(model.layers[i].attn.indexer is None for i in reusers)
    stages, planned = stage_parameters(config, ParallelConfig(pp=2))

    def numel(module) -> int:
        return sum(p.numel() for p in module.parameters())
    for s, stage in enumerate(stages):
        # as in parallel/sharded.py: embeddings on the first stage, final norm + LM head on the last, no vision
        real = sum(numel(model.layers[i]) for i in stage)
        real += numel(model.embed_tokens) if s == 0 else 0
        real += numel(model.norm) + numel(model.lm_head) if s == len(stages) - 1 else 0
        routed = sum(numel(model.layers[i].ffn.experts) for i in stage if model.layers[i].is_moe)
        assert planned[s] == {"experts": routed, "other": real - routed}, f"stage {s}"


@pytest.mark.parametrize("tp", [1, 2])
def test_each_reusing_layer_drops_exactly_one_whole_indexer(shared, tp):
    """Under TP the indexer stays whole (parallel/tensor.py shard_dsa), so a reuser saves its full size per rank."""
    config, reusers = shared
    indexer = sum(p.numel() for p in build_meta_model(config).layers[config.index_source(reusers[0])]
                  .attn.indexer.parameters())
    _, own = stage_parameters(config.replace(dsa={"index_share_every": 1}), ParallelConfig(tp=tp, pp=2))
    _, sharing = stage_parameters(config, ParallelConfig(tp=tp, pp=2))
    # the stages may differ (partition_layers never splits a group of index-sharing layers): compare the sums
    assert sum(s["experts"] for s in own) == sum(s["experts"] for s in sharing)
    assert sum(s["other"] for s in own) - sum(s["other"] for s in sharing) == indexer * len(reusers)


def test_kv_state_equals_the_bytes_the_paged_pools_allocate(shared):
    config, reusers = shared
    # bf16 latent rows and conv tails (cache_bytes = act_bytes = 2), FP8 index keys + one fp32 scale per token
    workload = Workload(mode="serve", seq_len=BLOCKS * BLOCK_SIZE, sequences=1, prefill_chunk=BLOCK_SIZE,
                        cache_bytes=2, act_bytes=2)
    pools = PagedPools(config, BLOCKS, BLOCK_SIZE, 1, dtype=torch.bfloat16,
                       index_format=QuantizedIndexFormat(config.indexer.head_dim))
    assert all(pools.layer(i).index.numel() == 0 for i in reusers)

    def nbytes(pool) -> int:
        tensors = (pool.latent, pool.index) if isinstance(pool, DSAPool) else (pool.state, pool.conv)
        return sum(t.numel() * t.element_size() for t in tensors)
    stages, _ = stage_parameters(config, ParallelConfig(pp=2))
    planned = device_memory(config, ParallelConfig(pp=2), workload)
    for s, stage in enumerate(stages):
        assert planned[s].kv_state == sum(nbytes(pools.layer(i)) for i in stage), f"stage {s}"
    total = sum(m.kv_state for m in planned)
    assert total == sum(pools.nbytes().values())
    unshared = sum(m.kv_state for m in device_memory(config.replace(dsa={"index_share_every": 1}),
                                                     ParallelConfig(pp=2), workload))
    assert unshared - total == len(reusers) * workload.seq_len * (config.indexer.head_dim + 4)
