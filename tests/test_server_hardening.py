"""The outside reliability review's HTTP reproducers: a long stop string, slow uploads, a stalled forward,
the Bearer scheme's case, the API key in `ps` (docs/design.md §10)."""
import argparse
import os
import random
import socket
import threading
import time
import types

import httpx
import pytest

from latentmoe_lab.server.cli import _api_key, access_log_config
from latentmoe_lab.server.stops import StopMatcher
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving.workers.parallel_runner import ParallelRunner, _process_state

KEY = "hardening-key"
SERVICE = {"model": {"name": "tiny-test", "preset": "tiny", "max_model_len": 128},
           "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000},
           "scheduler": {"max_batch_size": 8, "prefill_chunk_size": 32},
           "server": {"max_body_bytes": 2_000_000, "body_timeout_s": 1.0, "health_stall_s": 0.3}}
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": "tiny-test", "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def service():
    with start_service(SERVICE, api_key=KEY) as (served, worker):
        yield served, worker


def test_a_megabyte_stop_string_is_refused_at_once_and_health_answers(service):
    url = service[0].url
    response = httpx.post(f"{url}/v1/completions", json={**OK, "stop": "x" * 1_040_000}, headers=AUTH, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
    longest = httpx.post(f"{url}/v1/completions", json={**OK, "stop": ["x" * 256] * 4}, headers=AUTH, timeout=30)
    assert longest.status_code == 200 and httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("seed", range(30))
def test_incremental_stop_matching_equals_a_plain_search(seed):
    """Self-overlapping stops (KMP's failure links) over random chunkings: the text ends before the stop
    that completes first, as a search of the whole text for the earliest end says."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(60))
    stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    expected = text if not ends else text[:min(ends)[0] + min(ends)[1]]
    matcher, out, i = StopMatcher(stops), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        out.append(matcher.feed(text[i:i + n]))
        i += n
    out.append(matcher.flush())
    assert "".join(out) == expected and matcher.stopped == bool(ends)


def test_half_a_body_is_dropped_after_the_body_timeout(service):
    served = service[0]
    with socket.create_connection((served.host, served.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n{\"model\":")
        reply = b""
        while chunk := sock.recv(4096):  # until the server closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in reply


def test_bearer_scheme_in_any_case_and_401_names_the_scheme(service):
    url = service[0].url
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        refused = httpx.get(f"{url}/v1/models", headers=header)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"


def test_health_says_stalled_while_a_step_hangs(service):
    url, worker = service[0].url, service[1]
    release = threading.Event()
    hook = worker.model.register_forward_pre_hook(lambda *_: release.wait(10) and None)
    try:
        thread = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                  kwargs={"json": OK, "headers": AUTH, "timeout": 60})
        thread.start()
        deadline, health = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            health = httpx.get(f"{url}/health")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["reason"].startswith("stalled: a step has run for")
    finally:
        release.set()
        hook.remove()
    thread.join(timeout=60)
    assert httpx.get(f"{url}/health").status_code == 200


def test_forward_process_state_reads_stopped_and_exited():
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _process_state(child) is None
        os.kill(child.pid, 19)  # SIGSTOP
        deadline = time.monotonic() + 5
        while _process_state(child) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _process_state(child) == "stopped"
    finally:
        child.kill()
        child.wait(timeout=10)
    assert _process_state(child) == "exited"


def test_a_killed_worker_group_reads_as_absent():
    """After a crash loop the group is killed and restarted only at the next step: /health must say so."""
    runner = ParallelRunner.__new__(ParallelRunner)  # no processes started: only the group's state matters
    runner.group = types.SimpleNamespace(conns=[], processes=[])
    assert runner.unavailable_workers() == ["processes: none running (the group is restarted at the next step)"]


def test_api_key_file_keeps_the_key_out_of_the_command_line(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\nignored\n")
    args = argparse.Namespace(api_key=None, api_key_file=str(key_file))
    assert _api_key(args) == "s3cret"
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty").write_text("\n")
    for path, rule in ((tmp_path / "fifo", "not a regular file"), (tmp_path / "empty", "holds no key"),
                       (tmp_path / "missing", "not a regular file")):
        with pytest.raises(ValueError, match=f"--api-key-file: .*{rule}"):
            _api_key(argparse.Namespace(api_key=None, api_key_file=str(path)))
    with pytest.raises(ValueError, match="--api-key-file: give it or --api-key, not both"):
        _api_key(argparse.Namespace(api_key="x", api_key_file=str(key_file)))


def test_access_log_omits_the_query_string(capsys):
    """A key sent as ?api_key=... reached uvicorn's access log; `serve` logs the path without the query."""
    import logging.config

    logging.config.dictConfig(access_log_config())  # what uvicorn.run applies
    try:
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET",
                                                 "/v1/models?api_key=s3cret", "1.1", 401)
        line = capsys.readouterr().out
    finally:
        logging.getLogger("uvicorn.access").handlers.clear()
    assert "s3cret" not in line
    assert '"GET /v1/models?<query omitted> HTTP/1.1" 401' in line
