"""Parallel serving (docs/design.md §10): an EP2xTP2 engine on 4 gloo worker processes gives the greedy tokens
of the one-process engine, survives a worker killed with SIGKILL mid-generation, and leaves no process behind."""
import os
import signal
import threading

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.server.prom import ServerMetrics
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving import Engine, ServiceConfig
from latentmoe_lab.serving.workers.parallel_runner import WorkerGroupError
from latentmoe_lab.parallel.comm import CommEvent
from latentmoe_lab.serving.workers.parallel_worker import busy_seconds, pack_batch

from serving_cases import PARAMS, PROMPTS, SERVICE, one_process_tokens, started_engine

EP2TP2 = SERVICE | {"parallel": {"tensor_parallel_size": 2, "expert_parallel_size": 2}}


@pytest.fixture(scope="module")
def reference(model):
    return one_process_tokens(model, PROMPTS)


@pytest.fixture(scope="module")
def engine(model):
    yield from started_engine(model, EP2TP2["parallel"])


def test_ep2tp2_greedy_equals_one_process(engine, reference):
    assert len(engine.runner.pids) == 4
    outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    assert [o.token_ids for o in outputs] == reference
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0  # slot copies reached every rank's pools
    assert stats["blocks_used"] == 0 and stats["slots_used"] == 0
    forward, collective = stats["rank_forward_seconds"], stats["rank_collective_seconds"]
    assert len(forward) == len(collective) == 4  # every rank measured its own part
    assert engine.runner.group.pool_bytes == [engine.plan.total_bytes] * 4  # planned == allocated, per rank
    assert all(c > 0 for c in collective) and all(c <= f for c, f in zip(collective, forward))
    assert len(stats["rank_resident_bytes"]) == 4 and all(b > 2**20 for b in stats["rank_resident_bytes"])


def test_collective_seconds_count_overlapping_events_once():
    events = [CommEvent("all_to_all", "a", 0.0, 4.0, 0), CommEvent("all_reduce", "b", 1.0, 2.0, 0),
              CommEvent("send", "c", 3.0, None, 0), CommEvent("all_reduce", "d", 5.0, 5.5, 0)]
    assert busy_seconds(events) == 4.5  # [0, 4] holds [1, 2]; an unwaited event counts nothing
    assert busy_seconds([]) == 0.0


def test_rank_seconds_counters_keep_moving_across_an_engine_replacement():
    metrics = ServerMetrics()
    base = {"running": 0, "waiting": 0, "blocks_used": 0, "num_blocks": 8, "slots_used": 0, "num_slots": 2,
            "cached_blocks": 0, "preemptions": 0, "prefix_hit_tokens": 0, "worker_restarts": 0}
    for forward, collective in (([1.0, 2.0], [0.5, 1.0]), ([3.0, 5.0], [1.0, 2.0])):
        metrics.observe_engine(base | {"rank_forward_seconds": forward, "rank_collective_seconds": collective,
                                       "rank_resident_bytes": [1, 2]})
    metrics.engine_replaced()  # a fresh engine's totals start at zero again
    metrics.observe_engine(base | {"rank_forward_seconds": [0.5, 0.25], "rank_collective_seconds": [0.0, 0.25],
                                   "rank_resident_bytes": [1, 2]})
    samples = {(f.name, s.labels["rank"]): s.value
               for f in text_string_to_metric_families(metrics.exposition().decode())
               for s in f.samples if s.name.startswith("latentmoe_rank_") and s.name.endswith("_total")}
    assert samples == {("latentmoe_rank_forward_seconds", "0"): 3.5, ("latentmoe_rank_forward_seconds", "1"): 5.25,
                       ("latentmoe_rank_collective_seconds", "0"): 1.0,
                       ("latentmoe_rank_collective_seconds", "1"): 2.25}


@pytest.mark.parametrize("victim", [2, 0])  # a plain rank; rank 0, the one that talks to the engine
def test_killed_worker_mid_generation_is_replaced_and_outputs_equal(engine, reference, victim):
    restarts, old_pids = engine.stats()["worker_restarts"], list(engine.runner.pids)
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    results, killed = {}, False
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        running = engine.scheduler.running
        if not killed and any(seq.generated_ids for seq in running):  # mid-generation
            os.kill(old_pids[victim], signal.SIGKILL)
            killed = True
    assert killed
    assert [results[i].token_ids for i in ids] == reference
    assert [results[i].finish_reason for i in ids] == ["length"] * len(PROMPTS)
    assert engine.stats()["worker_restarts"] == restarts + 1
    assert not set(engine.runner.pids) & set(old_pids)
    assert not any(psutil.pid_exists(pid) for pid in old_pids)  # the old group was killed and reaped


def test_a_rank_that_raises_is_reported_and_the_next_step_restarts_the_group(engine, reference):
    bad = ForwardBatch.from_sequences([[1, 2]], [0], [[0]], state_slots=[10_000], block_size=16)
    with pytest.raises(WorkerGroupError, match="batch.state_slot") as caught:
        engine.runner.group.step(*pack_batch(bad, []))
    assert not caught.value.lost  # an exception of the model, not a lost process
    restarts = engine.stats()["worker_restarts"]
    outputs = engine.generate(PROMPTS[:3], PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference[:3]
    assert engine.stats()["worker_restarts"] == restarts + 1


def test_close_leaves_no_worker_process(model):
    engine = Engine(model, ServiceConfig.from_dict(EP2TP2))
    pids = list(engine.runner.pids)
    assert all(psutil.pid_exists(pid) for pid in pids)
    engine.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    engine.close()  # twice is harmless


def test_server_keeps_every_stream_through_a_killed_worker_and_counts_the_restart(reference):
    with start_service(EP2TP2 | {"server": {"max_retries": 2}}) as (served, worker):
        first_pids = list(worker.engine.runner.pids)
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0, timeout=120)
        results, errors, first_token = [None] * len(PROMPTS), [], threading.Event()

        def one(i):
            try:
                ids = []
                for chunk in client.completions.create(model="latentmoe", prompt=PROMPTS[i], max_tokens=6,
                                                       temperature=0, stream=True):
                    ids += chunk.choices[0].model_extra["token_ids"]
                    first_token.set()
                results[i] = ids
            except Exception as error:  # noqa: BLE001 - collected and asserted
                errors.append(repr(error))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        assert first_token.wait(60)
        os.kill(first_pids[1], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=120)
        assert errors == [] and results == reference
        line = 'latentmoe_engine_restarts_total{cause="parallel_worker_lost"} '
        metrics = httpx.get(served.url + "/metrics").text.splitlines()
        assert float(next(x for x in metrics if x.startswith(line)).split()[-1]) == 1
        families = {f.name: f for f in text_string_to_metric_families("\n".join(metrics) + "\n")}
        for name in ("latentmoe_rank_forward_seconds", "latentmoe_rank_collective_seconds"):
            series = {s.labels["rank"]: s.value for s in families[name].samples if s.name.endswith("_total")}
            assert sorted(series) == ["0", "1", "2", "3"] and all(v > 0 for v in series.values())
        resident = {s.labels["rank"]: s.value for s in families["latentmoe_worker_resident_memory_bytes"].samples}
        assert sorted(resident) == ["0", "1", "2", "3"] and all(v > 2**20 for v in resident.values())
        pids = first_pids + list(worker.engine.runner.pids)
    assert not any(psutil.pid_exists(pid) for pid in pids)  # stopping the server stopped its workers


@pytest.mark.parametrize("parallel, key", [
    ({"tensor_parallel_size": 3}, "parallel.tensor_parallel_size: 3 must divide kda.num_heads"),
    ({"expert_parallel_size": 3}, "parallel.expert_parallel_size: 3 must divide moe.num_experts"),
])
def test_bad_parallel_sizes_name_the_key(model, parallel, key):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=key):
        Engine(model, ServiceConfig.from_dict(SERVICE | {"parallel": parallel}))
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children  # nothing was started
