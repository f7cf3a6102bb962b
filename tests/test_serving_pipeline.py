"""Pipeline-parallel serving (docs/design.md §10): PP2 on 2 gloo worker processes and PP2xTP2 on 4 give the
greedy tokens of the one-process engine, each rank allocates exactly its stage's plan, and a rank of the last
stage killed with SIGKILL mid-generation is replaced with outputs unchanged."""
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.paged_pools import paged_pool_bytes
from latentmoe_lab.serving import Engine, ServiceConfig
from latentmoe_lab.serving.config import serving_layout
from latentmoe_lab.serving.planner import plan_cache
from latentmoe_lab.serving.workers.pipeline_stage import plan_stages, stage_config

from serving_cases import PARAMS, SERVICE, one_process_tokens, started_engine
from serving_cases import PROMPTS as BASE_PROMPTS

PP2 = SERVICE | {"parallel": {"pipeline_parallel_size": 2}}
PP2TP2 = SERVICE | {"parallel": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}}
# an image whose 4 placeholders straddle the first chunk's end (stage 0 merges its features)
IMAGE = torch.rand(3, 56, 56, generator=torch.Generator().manual_seed(3))
PROMPTS = BASE_PROMPTS + [{"text": "x" * 30 + "<image>" + "y" * 9, "images": [IMAGE]}]


@pytest.fixture(scope="module")
def reference(model):
    return one_process_tokens(model, PROMPTS)


@pytest.fixture(scope="module")
def engine(model):
    yield from started_engine(model, PP2["parallel"])


def check_rank_figures(engine, world: int) -> None:
    """Each rank allocated exactly its stage's plan; each measured its own forward and collective seconds."""
    stats, stages = engine.stats(), engine.stages
    per_stage = world // len(stages)
    planned = [stage.plan.total_bytes for stage in stages for _ in range(per_stage)]
    assert engine.runner.group.pool_bytes == planned
    assert len({stage.plan.num_blocks for stage in stages}) == 1  # one block table for every stage
    forward, collective = stats["rank_forward_seconds"], stats["rank_collective_seconds"]
    assert len(forward) == len(collective) == world
    assert all(c > 0 for c in collective) and all(c <= f for c, f in zip(collective, forward))


def test_pp2_greedy_equals_one_process(engine, reference):
    assert len(engine.runner.pids) == 2 and [s.layers for s in engine.stages] == [range(0, 2), range(2, 4)]
    outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    assert [o.token_ids for o in outputs] == reference
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0  # slot copies reached both stages' pools
    assert stats["blocks_used"] == 0 and stats["slots_used"] == 0
    check_rank_figures(engine, 2)


def test_pp2tp2_on_four_processes_equals_one_process(model, reference):
    engine = Engine(model, ServiceConfig.from_dict(PP2TP2))
    try:
        assert len(engine.runner.pids) == 4
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference
        check_rank_figures(engine, 4)
    finally:
        engine.close()


def test_killed_rank_of_the_last_stage_mid_generation_is_replaced_and_outputs_equal(engine, reference):
    restarts, old_pids = engine.stats()["worker_restarts"], list(engine.runner.pids)
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    results, killed = {}, False
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        if not killed and any(seq.generated_ids for seq in engine.scheduler.running):  # mid-generation
            os.kill(old_pids[engine.runner.group.answer_rank], signal.SIGKILL)  # rank 1: the last stage
            killed = True
    assert killed and engine.runner.group.answer_rank == 1
    assert [results[i].token_ids for i in ids] == reference
    assert engine.stats()["worker_restarts"] == restarts + 1
    assert not any(psutil.pid_exists(pid) for pid in old_pids)


def test_a_hung_rank_is_detected_within_the_configured_group_timeout(model, reference):
    # 6 s: the timeout also bounds the restarted group's start, which took over 3 s on a loaded 2-core machine
    engine = Engine(model, ServiceConfig.from_dict(PP2 | {"parallel": {"pipeline_parallel_size": 2,
                                                                      "group_timeout_s": 6.0}}))
    old_pids = list(engine.runner.pids)
    try:
        ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
        results, stopped, detected = {}, False, None
        while engine.has_unfinished():
            start = time.monotonic()
            outputs = engine.step()
            if stopped and detected is None:
                detected = time.monotonic() - start
            results.update({o.request_id: o for o in outputs if o.finished})
            if not stopped and any(seq.generated_ids for seq in engine.scheduler.running):
                os.kill(old_pids[0], signal.SIGSTOP)  # alive but silent: only the timeout can tell
                stopped = True
        assert [results[i].token_ids for i in ids] == reference
        assert engine.stats()["worker_restarts"] >= 1
        assert detected < 20  # the 6 s timeout of this config, not the 30 s default
        assert not any(psutil.pid_exists(pid) for pid in old_pids)  # the stopped rank was killed too
    finally:
        engine.close()


def test_shipped_pp2_config_plans_two_stages():
    service = ServiceConfig.from_yaml(Path(__file__).parents[1] / "configs" / "service-cpu-pp2.yaml")
    config = ModelConfig.from_preset(service.model.preset)
    stages = plan_stages(config, service, serving_layout(config, service.parallel))
    assert [s.layers for s in stages] == [range(0, 2), range(2, 4)]
    assert all(s.plan.total_bytes <= service.memory.cache_bytes for s in stages)
    assert stages[0].plan.num_blocks * service.memory.block_size >= service.model.max_model_len


def test_every_stage_is_planned_on_its_own_layers_with_the_most_demanding_block_count():
    config = ModelConfig.from_preset("tiny").replace(num_layers=8)  # kda kda kda dsa kda kda kda dsa
    service = ServiceConfig.from_dict(SERVICE | {"parallel": {"pipeline_parallel_size": 3, "tensor_parallel_size": 2}})
    stages = plan_stages(config, service, serving_layout(config, service.parallel))
    assert [s.layers.start for s in stages][0] == 0 and stages[-1].layers.stop == 8
    assert all(a.layers.stop == b.layers.start for a, b in zip(stages, stages[1:]))  # contiguous
    for stage in stages:
        plan = stage.plan
        assert plan.config.layer_types == [config.layer_types[i] for i in stage.layers]
        assert plan.config.kda.num_heads == config.kda.num_heads // 2  # local heads
        kinds = paged_pool_bytes(plan.config, plan.num_blocks, plan.block_size, plan.pool_rows, plan.dtype,
                                 plan.latent_format, plan.index_format)
        assert sum(kinds.values()) == plan.total_bytes <= plan.budget
    alone = [plan_cache(stage_config(config, s.layers, 2), service).num_blocks for s in stages
             if "dsa" in s.plan.config.layer_types]  # a stage without DSA layers stores nothing per block
    assert len(alone) >= 2 and len(set(alone)) > 1  # the stages differ, and the most demanding one decides
    assert all(s.plan.num_blocks == min(alone) for s in stages)


@pytest.mark.parametrize("parallel, key", [
    ({"pipeline_parallel_size": 5}, "parallel.pipeline_parallel_size: 5 stages need at least one layer each"),
    ({"pipeline_parallel_size": 0}, "parallel.pipeline_parallel_size: must be a positive integer"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 3}, "parallel.tensor_parallel_size: 3 must divide"),
])
def test_bad_pipeline_sizes_name_the_key(model, parallel, key):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=key):
        Engine(model, ServiceConfig.from_dict(SERVICE | {"parallel": parallel}))
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children  # nothing was started
