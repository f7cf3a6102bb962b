"""The shared-prefix workload of the prefix-cache spill tests (test_prefix_spill.py in the engine's process,
test_cache_tiers_workers.py on worker processes): a device cache of 9 blocks and 2 snapshot rows per rank, and
three 256-token prefixes taking turns, so every second visit of a prefix finds it spilled."""
import pytest
import torch

from latentmoe_lab.paged_pools import DSAPool
from latentmoe_lab.serving import SamplingParams, ServiceConfig
from latentmoe_lab.serving.invariance import recorded_logits
from latentmoe_lab.serving.planner import pools_bytes

PARAMS = SamplingParams(max_tokens=3)
BLOCK = 64


def block_views(pools, kind: str, index: int) -> dict[str, torch.Tensor]:
    """Views of in-process pools as a spill entry names them: block `index` in every DSA layer ("rows") or row
    `index` of every KDA layer ("kda"), for tests that fill and inspect the pools (cache_tiers/spill_blocks.py)."""
    views = {}
    for i, pool in enumerate(pools.layers):
        if kind == "rows" and isinstance(pool, DSAPool):
            views[f"layer{i}.latent"] = pool.latent[index]
            if pool.index.shape[0]:  # a layer reusing another's selection keeps no keys (dsa.index_share_every)
                views[f"layer{i}.index"] = pool.index[index]
        elif kind == "kda" and not isinstance(pool, DSAPool):
            views |= {f"layer{i}.state": pool.state[index], f"layer{i}.conv": pool.conv[index]}
    return views


def pool_store(pools):
    """The spill's store (RunnerBlocks) over in-process pools, as an engine's ModelRunner gives it its pools."""
    from latentmoe_lab.serving.cache_tiers.spill_blocks import RunnerBlocks
    from latentmoe_lab.serving.model_runner import LocalPools

    return RunnerBlocks(pools.config, pools, LocalPools(pools))


def view_shapes(pools, kind: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of block_views(pools, kind, 0): what a spill entry of the pools holds."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in block_views(pools, kind, 0).items()}


def spill_service(model, spill=None, parallel=None, prefix=True, kv_cache_dtype="auto", offload=None,
                  batch_invariant=False) -> ServiceConfig:
    """1 running + 2 snapshot rows and 9 blocks (512 tokens + 1) per rank; `spill`: memory.prefix_cache's tier
    keys; with `offload`, host_cache_bytes sets the blocks' latent rows."""
    data = {"model": {"max_model_len": 512}, "parallel": parallel or {},
            "memory": {"block_size": BLOCK, "max_num_seqs": 1, "kv_cache_dtype": kv_cache_dtype,
                       **({"prefix_cache": {"snapshot_slots": 2} | (spill or {})} if prefix else {}),
                       **({"offload": offload} if offload else {})},
            "scheduler": {"prefill_chunk_size": 512, "batch_invariant": batch_invariant, "max_batch_size": 4}}
    probe = ServiceConfig.from_dict(data)
    block, slot = pools_bytes(model.config, probe, 1, 0), pools_bytes(model.config, probe, 0, 1)
    data["memory"]["cache_bytes"] = 3 * slot + 9 * block
    return ServiceConfig.from_dict(data)


@pytest.fixture(scope="module")
def prompts():
    """Six requests: three 4-block prefixes in turn, each with a short suffix of its own."""
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 256, (4 * BLOCK,), generator=g).tolist() for _ in range(3)]
    suffixes = ([1, 2, 3], [4, 5], [9], [7, 8, 9, 10], [11], [3, 3])
    return [prefixes[i % 3] + suffix for i, suffix in enumerate(suffixes)]


def serve(engine, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """One request at a time (the device cache is too small to hold two prefixes) -> (tokens, the logits rows
    sampled from, in request and position order)."""
    with recorded_logits(engine) as rows:
        outputs = [engine.generate([prompt], PARAMS, use_tqdm=False)[0] for prompt in prompts]
    return [o.token_ids for o in outputs], [rows[key] for key in sorted(rows)]
