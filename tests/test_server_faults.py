"""Failover: a failed step is retried by recompute (a poison request failing alone, its step-mates unharmed),
a dead or hung engine thread restarted with its weights reloaded; clients see no error and greedy outputs
equal an unfaulted run (docs/design.md §6.5, §10)."""
import threading
import time

import httpx
import openai
import pytest

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving import Engine, SamplingParams
from latentmoe_lab.serving.workers.parallel_runner import ParallelRunner

SERVICE = {"model": {"name": "tiny-test", "preset": "tiny", "max_model_len": 256},
           "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000},
           "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 32},
           "server": {"max_retries": 2, "step_timeout_s": 3.0}}
PROMPTS = ["first request", "b", "a longer third request, longer than one chunk of 32 tokens", "fourth", "fifth!"]
NEW_TOKENS = 10


class WorkerKilled(BaseException):
    """Not an Exception: it escapes the step loop and ends the engine thread, as a crash would."""


@pytest.fixture(scope="module")
def service():
    with start_service(SERVICE) as (served, worker):
        yield served, worker


@pytest.fixture(scope="module")
def reference():
    config, _ = split_service_dict(SERVICE)
    outs = Engine(load_model(config), config).generate([list(p.encode()) for p in PROMPTS],
                                                       SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outs]


def _fault_on_call(engine, call: int, fault) -> None:
    """Make the call-th engine.step() of this engine run `fault` instead (once)."""
    original, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == call:
            fault()
        return original()

    engine.step = step


def _run_all(url) -> tuple[list, list]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    results, errors = [None] * len(PROMPTS), []

    def one(i):
        try:
            kwargs = dict(model="tiny-test", prompt=PROMPTS[i], max_tokens=NEW_TOKENS, temperature=0)
            if i % 2:
                chunks = client.completions.create(stream=True, **kwargs)
                results[i] = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
            else:
                results[i] = client.completions.create(**kwargs).choices[0].model_extra["token_ids"]
        except Exception as error:  # noqa: BLE001 - collected and asserted
            errors.append(repr(error))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results, errors


def _restarts(url, cause) -> float:
    line = f'latentmoe_engine_restarts_total{{cause="{cause}"}} '
    return next(float(x.split()[-1]) for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(line))


def _retries(url) -> float:
    return next(float(x.split()[-1]) for x in httpx.get(f"{url}/metrics").text.splitlines()
                if x.startswith("latentmoe_request_retries_total "))


def _idle(url) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health").json()
        if health["running"] == health["waiting"] == health["blocks_used"] == health["slots_used"] == 0:
            return health
        time.sleep(0.1)
    raise AssertionError(f"not idle: {health}")


def _raise_runtime_error():
    raise RuntimeError("injected step failure")


def _kill():
    raise WorkerKilled()


def _hang():
    time.sleep(4.5)  # past step_timeout_s = 3: the watchdog restarts while this thread still sleeps


@pytest.mark.parametrize("fault, cause", [(_raise_runtime_error, "step_failed"), (_kill, "worker_died"),
                                          (_hang, "worker_hung")])
def test_fault_mid_generation_is_invisible_to_clients(service, reference, fault, cause):
    served, worker = service
    before, retries_before = _restarts(served.url, cause), _retries(served.url)
    model_before, engine_before = worker.model, worker.engine
    _fault_on_call(worker.engine, 4, fault)  # a few steps in: prefill chunks done, tokens streamed
    results, errors = _run_all(served.url)
    assert errors == []
    assert results == reference
    assert _restarts(served.url, cause) == before + 1
    if cause == "step_failed":  # raised outside the forward: nobody named, so all charged, the engine reset
        assert _retries(served.url) > retries_before
        assert worker.engine is engine_before and worker.model is model_before  # same pools, same weights
    else:
        assert worker.model is not model_before  # weights reloaded
    assert _idle(served.url)["status"] == "ok"


def _hook_forward(worker, fails):
    """A pre-hook on the engine's model (the forward runs in this process): fails(batch) -> raise. Returns
    the hook's handle and the sizes of the steps it failed."""
    assert not isinstance(worker.engine.runner, ParallelRunner)
    failed = []

    def hook(module, args, kwargs):
        if fails(args[0], kwargs["batch"]):
            failed.append(kwargs["batch"].num_seqs)
            raise RuntimeError("injected forward failure")
    return worker.model.register_forward_pre_hook(hook, with_kwargs=True), failed


def _when_running(url, count: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").json()["running"] < count:
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.01)


def test_a_poison_request_fails_alone_and_its_step_mates_finish_unharmed(service, reference):
    served, worker = service
    url, limit = served.url, SERVICE["server"]["max_retries"]
    poison = next(t for t in range(256, 512) if all(t not in r for r in reference))
    retries_before, restarts_before = _retries(url), _restarts(url, "step_failed")
    handle, failed = _hook_forward(worker, lambda ids, batch: bool((ids == poison).any()))
    innocents: dict = {}
    try:
        clients = threading.Thread(target=lambda: innocents.update(zip(("results", "errors"), _run_all(url))))
        clients.start()
        _when_running(url, 2)  # the poison joins steps of running innocents
        bad = httpx.post(f"{url}/v1/completions", timeout=60,
                         json={"model": "tiny-test", "prompt": [65, poison, 66], "max_tokens": NEW_TOKENS})
        clients.join(timeout=120)
    finally:
        handle.remove()
    assert innocents["errors"] == [] and innocents["results"] == reference  # and none of them was charged:
    assert _retries(url) == retries_before + limit  # the poison's retries, no more
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["code"] == "engine_step_failed" and error["message"].endswith(f"(after {limit} retries)")
    assert max(failed) > 1 and failed[-limit - 1:] == [1] * (limit + 1)  # bisected down to the poison alone
    assert _restarts(url, "step_failed") == restarts_before  # the engine settled it: no reset
    assert _idle(url)["status"] == "ok"


def test_a_transient_forward_failure_is_invisible_and_charges_nobody(service, reference):
    served, worker = service
    retries_before, engine_before = _retries(served.url), worker.engine
    handle, failed = _hook_forward(worker, lambda ids, batch: batch.num_seqs > 1 and not failed)
    try:
        results, errors = _run_all(served.url)
    finally:
        handle.remove()
    assert failed and failed[0] > 1  # it did fail a step of several requests, once
    assert errors == [] and results == reference
    assert _retries(served.url) == retries_before and worker.engine is engine_before
    assert _idle(served.url)["status"] == "ok"


def test_a_step_that_always_fails_fails_the_request_alone(service, monkeypatch):
    served, worker = service
    url = served.url
    retries_before = _retries(url)
    monkeypatch.setattr(Engine, "step", lambda self: _raise_runtime_error())
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "doomed", "max_tokens": 4},
                          timeout=60)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "engine_step_failed" and "after 2 retries" in error["message"]
    assert _retries(url) == retries_before + 2  # retried after the first max_retries failures, then failed
    monkeypatch.undo()
    ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "fine", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4
    assert _idle(url)["status"] == "ok"


def test_past_max_restarts_the_service_says_unavailable():
    with start_service({**SERVICE, "server": {"max_restarts": 0}}) as (served, worker):
        url = served.url
        _fault_on_call(worker.engine, 2, _kill)
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x", "max_tokens": 8},
                              timeout=60)
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{url}/health").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x"}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{url}/metrics").status_code == 200  # the HTTP side still answers
