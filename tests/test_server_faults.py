"""Failover: a failed step is retried by recompute, a dead or hung engine thread restarted with its weights
reloaded; clients see no error and greedy outputs equal an unfaulted run (docs/design.md §10)."""
import threading
import time

import httpx
import openai
import pytest

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving import Engine, SamplingParams

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
    model_before = worker.model
    _fault_on_call(worker.engine, 4, fault)  # a few steps in: prefill chunks done, tokens streamed
    results, errors = _run_all(served.url)
    assert errors == []
    assert results == reference
    assert _restarts(served.url, cause) == before + 1
    if cause == "step_failed":
        assert _retries(served.url) > retries_before  # the step's requests were charged and re-queued
        assert worker.model is model_before  # same weights, fresh pools
    else:
        assert worker.model is not model_before  # weights reloaded
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
    assert _retries(url) == retries_before + 3  # charged on each of 1 + max_retries failed steps
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
