"""A disaggregated service's instances that die while starting or stop (serving/disagg/liveness.py).

A replacement killed while it loads its weights used to leave /health at 503 "restarting" for good, with
requests timing out; a SIGSTOPped instance used to leave /health at 200 while requests stalled. Now the
replacement is restarted again (with a growing delay, within server.max_restarts) and the service heals;
a stopped instance shows in /health at once and is killed after STUCK_KILL_S, so that it is replaced and its
requests recomputed. Every wait is bounded; loopback only.
"""
import os
import signal
import time

import httpx
import pytest

from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving.disagg import liveness

SERVICE = {"model": {"name": "tiny-pd", "preset": "tiny", "max_model_len": 256},
           "parallel": {"forward_threads": 1},
           "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000},
           "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 64},
           "disaggregation": {"prefill_instances": 1, "decode_instances": 1}}
REQUEST = {"model": "tiny-pd", "prompt": "def add(a, b):\n", "max_tokens": 8, "temperature": 0}
HEAL_TIMEOUT_S = 120


def _health(url: str) -> tuple[int, dict]:
    reply = httpx.get(url + "/health", timeout=10)
    return reply.status_code, reply.json()


def _until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {timeout} s: {what}")


def _text(url: str) -> list[int]:
    reply = httpx.post(url + "/v1/completions", json=REQUEST, timeout=HEAL_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_a_replacement_killed_while_starting_is_restarted_until_the_service_heals():
    with start_service(SERVICE) as (served, worker):
        expected = _text(served.url)
        router = worker.router
        first = router.instances["decode"][0]
        first.process.kill()
        replacement = _until(lambda: (i := router.instances["decode"][0]) is not first and i, 30,
                             "a replacement started")
        assert not replacement.ready.is_set()
        replacement.process.kill()  # while it loads: it used to be left dead, /health 503 "restarting" forever
        _until(lambda: _health(served.url)[0] == 200, HEAL_TIMEOUT_S, "/health back to 200")
        assert router.instances["decode"][0] not in (first, replacement)
        assert router.restarts["decode"] == 2 and not router.gave_up
        assert _text(served.url) == expected


@pytest.mark.slow
def test_a_stopped_instance_shows_in_health_and_is_replaced(monkeypatch):
    monkeypatch.setattr(liveness, "STUCK_KILL_S", 3.0)
    with start_service(SERVICE) as (served, worker):
        expected = _text(served.url)
        stopped = worker.router.instances["decode"][0]
        os.kill(stopped.process.pid, signal.SIGSTOP)
        try:
            status, body = _until(lambda: (h := _health(served.url))[0] == 503 and h, 10, "/health 503")
            assert "decode instance decode0" in body["reason"] and "stopped (SIGSTOP)" in body["reason"]
            assert _text(served.url) == expected  # recomputed on the replacement once the stopped one is killed
        finally:
            if stopped.process.is_alive():
                os.kill(stopped.process.pid, signal.SIGCONT)
        assert worker.router.restarts["decode"] == 1
        _until(lambda: _health(served.url)[0] == 200, HEAL_TIMEOUT_S, "/health back to 200")


def test_the_restart_delay_grows_and_is_bounded():
    assert [liveness.restart_delay(n) for n in range(9)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
