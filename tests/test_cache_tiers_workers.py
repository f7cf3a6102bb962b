"""The cache hierarchy (docs/design.md §15) with the forward on worker processes: DSA rows in a host tier built
by each rank, and the prefix-cache spill copying blocks and KDA snapshots out of and into the workers' pools.

Worker processes run without batch invariance (it needs the forward in the engine's process), so a hit is
compared with a fresh run by its greedy tokens and, to float tolerance, its logits; the bytes themselves are
compared exactly: an entry round-trips through the workers bit for bit, and a disk spill written by an
in-process engine serves a forward-process one (its files are refused unless every name, dtype and shape
matches, and a wrong byte would change the tokens).
"""
import os
import signal
import time

import psutil
import pytest
import torch

from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.cache_tiers.spill_blocks import KDA, ROWS
from latentmoe_lab.serving.planner import allocate_pools, plan_cache
from latentmoe_lab.serving.workers.parallel_runner import ParallelRunner

from spill_cases import BLOCK, PARAMS, prompts, serve, spill_service, view_shapes  # noqa: F401

FORWARD_PROCESS = {"forward_process": True}
OFFLOAD = {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 40}  # tiny's indexer keeps 32 rows


# ------------------------------------------------------------------ memory.offload on worker processes
def offload_service(offload, parallel=None) -> ServiceConfig:
    memory = {"max_num_seqs": 2, "block_size": 16, "cache_bytes": 3_000_000}
    return ServiceConfig.from_dict({"model": {"max_model_len": 1024}, "parallel": parallel or {},
                                    "memory": memory | ({"offload": offload} if offload else {}),
                                    "scheduler": {"max_batch_size": 4, "prefill_chunk_size": 256}})


@torch.no_grad()
def test_offload_on_a_forward_process_gives_the_plain_tokens_and_counts_its_rows(model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (600, 20)]  # 20 < top-k: dense reads
    params = SamplingParams(max_tokens=6)
    plain = [o.token_ids for o in Engine(model, offload_service(None)).generate(prompts, params, use_tqdm=False)]
    here = Engine(model, offload_service(OFFLOAD))
    here.generate(prompts, params, use_tqdm=False)
    engine = Engine(model, offload_service(OFFLOAD, FORWARD_PROCESS))
    try:
        assert engine.stats()["offload_rows_moved"] == 0  # the keys are there before the first step
        workers = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        stats = engine.stats()
    finally:
        engine.close()
    reference = model.generate(torch.tensor([prompts[0]]), max_new_tokens=6)[0, len(prompts[0]):].tolist()
    assert workers == plain and workers[0] == reference
    assert engine.runner.pools is None and engine.stages[0].plan.hot_rows == 40  # the worker built OffloadedPools
    counted = {key: value for key, value in stats.items() if key.startswith("offload_")}
    assert counted == {key: value for key, value in here.stats().items() if key.startswith("offload_")}
    assert counted["offload_rows_moved"] > 0 and counted["offload_host_read_rows"] > 0
    assert counted["offload_bytes_moved"] == counted["offload_rows_moved"] * 24 * 4  # 24 fp32 values per row
    assert (stats["blocks_used"], stats["slots_used"]) == (0, 0)


def test_without_offload_the_stats_have_no_offload_keys(model):
    assert not any(key.startswith("offload_") for key in Engine(model, offload_service(None)).stats())


# ------------------------------------------------------------------ the prefix-cache spill on worker processes
@pytest.fixture(scope="module")
def fresh(model, prompts):
    return serve(Engine(model, spill_service(model, prefix=False)), prompts)


def assert_like_fresh(run, fresh):
    tokens, rows = run
    assert tokens == fresh[0] and len(rows) == len(fresh[1]) == 6 * PARAMS.max_tokens
    for row, expected in zip(rows, fresh[1]):  # another chunking sums in another order: float tolerance
        torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4)


def served_and_closed(engine, prompts):
    try:
        return serve(engine, prompts), engine.stats()
    finally:
        engine.close()


@pytest.mark.parametrize("tier, prefix_cache", [("host", {"host_bytes": 1 << 20}), ("disk", {"host_bytes": 0})])
def test_a_spilled_hit_on_a_forward_process_equals_a_fresh_run(model, prompts, fresh, tmp_path, tier, prefix_cache):
    engine = Engine(model, spill_service(model, prefix_cache | {"disk_dir": str(tmp_path)}, FORWARD_PROCESS))
    assert isinstance(engine.block_manager.store.runner, ParallelRunner)
    run, stats = served_and_closed(engine, prompts)
    assert_like_fresh(run, fresh)
    assert stats[f"prefix_hits_{tier}"] == 3 and stats["prefix_hit_tokens"] == 3 * 4 * BLOCK
    assert stats["prefix_hits_refused"] == 0 and stats[f"spill_bytes_{tier}_to_device"] > 0
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
    if tier == "disk":  # close() wrote what the workers' device cache held: an in-process engine serves it all
        reader = Engine(model, spill_service(model, {"disk_dir": str(tmp_path)}))
        tokens, _ = serve(reader, prompts)
        assert tokens == fresh[0] and reader.stats()["prefix_hits_disk"] == 6


def test_a_disk_spill_written_in_process_serves_a_forward_process(model, prompts, fresh, tmp_path):
    writer = Engine(model, spill_service(model, {"disk_dir": str(tmp_path)}))
    serve(writer, prompts)
    writer.close()  # every prefix's blocks and snapshot on disk
    engine = Engine(model, spill_service(model, {"disk_dir": str(tmp_path)}, FORWARD_PROCESS))
    assert engine.block_manager.disk.directory == writer.block_manager.disk.directory  # the same key
    assert engine.block_manager.expected == writer.block_manager.expected
    run, stats = served_and_closed(engine, prompts)
    assert_like_fresh(run, fresh)
    assert stats["prefix_hits_disk"] == 6 and stats["prefix_hits_refused"] == 0  # even first visits
    assert (stats["blocks_used"], stats["slots_used"]) == (0, 0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])  # fp8: quantized latent rows, block-planar index keys
def test_entries_round_trip_through_the_workers_byte_for_byte(model, kv_cache_dtype):
    service = spill_service(model, {"host_bytes": 1 << 20}, FORWARD_PROCESS, kv_cache_dtype=kv_cache_dtype)
    local = allocate_pools(model.config, plan_cache(model.config, service))  # the pools in one process
    engine = Engine(model, service)
    try:
        store = engine.block_manager.store
        assert store.shapes(ROWS) == view_shapes(local, ROWS) and store.shapes(KDA) == view_shapes(local, KDA)
        g = torch.Generator().manual_seed(5)
        def random_entry(kind):  # random bytes, whatever the dtype (fp8 codes, scales, fp32 states)
            return {name: torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=g,
                                        dtype=torch.uint8).view(dtype).view(shape)
                    for name, (dtype, shape) in store.shapes(kind).items()}

        written = {(ROWS, 2): random_entry(ROWS), (ROWS, 5): random_entry(ROWS), (KDA, 1): random_entry(KDA)}
        store.write([(kind, index, entry) for (kind, index), entry in written.items()])  # one message
        for (kind, index), entry in written.items():
            back = store.read(kind, index)
            assert back.keys() == entry.keys()
            assert all(torch.equal(back[name].view(torch.uint8), entry[name].view(torch.uint8)) for name in back)
        untouched = store.read(ROWS, 3)  # still the zeros the pools were allocated with
        assert all(not tensor.view(torch.uint8).any() for tensor in untouched.values())
    finally:
        engine.close()


def test_both_tiers_on_tensor_and_pipeline_parallel_workers(model, prompts, fresh):
    """TP 2 x PP 2: each rank's offloaded pools hold its stage's layers and heads; the spill gathers a block's
    whole-model rows and KDA heads from the four ranks and slices them back on a hit."""
    layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    # 60 kB of host tier: 9 blocks of the DSA stage's latent rows (the stage without DSA layers does not limit)
    engine = Engine(model, spill_service(model, {"host_bytes": 1 << 20}, layout, offload=OFFLOAD | {
        "host_cache_bytes": 60_000}))
    assert [stage.plan.num_blocks for stage in engine.stages] == [9, 9]
    run, stats = served_and_closed(engine, prompts)
    assert_like_fresh(run, fresh)
    assert stats["prefix_hits_host"] >= 1 and stats["prefix_hits_refused"] == 0
    assert stats["offload_rows_moved"] > 0
    assert (stats["blocks_used"], stats["slots_used"]) == (0, 0)


def test_a_worker_killed_under_the_spill_is_replaced_and_outputs_stay_right(model, prompts, fresh):
    """SIGKILL between requests: the next eviction's read finds the group dead (the entry is dropped, later
    reads are skipped), the step restarts the group and recomputes; nothing the dead pools held is served."""
    engine = Engine(model, spill_service(model, {"host_bytes": 1 << 20}, FORWARD_PROCESS))
    try:
        first = serve(engine, prompts[:3])
        victim = engine.runner.pids[0]
        os.kill(victim, signal.SIGKILL)
        while psutil.pid_exists(victim) and psutil.Process(victim).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        rest = serve(engine, prompts[3:])
        stats = engine.stats()
    finally:
        engine.close()
    assert first[0] + rest[0] == fresh[0]
    assert stats["worker_restarts"] == 1 and engine.block_manager.store.lost_group == 0
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
