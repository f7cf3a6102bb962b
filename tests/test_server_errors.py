"""Bad requests get 400 + an OpenAI-style body naming the field; a full queue 429; a client that leaves frees
its blocks; nothing a client sends stops the server (docs/design.md §10)."""
import socket
import threading
import time

import httpx
import openai
import pytest

from latentmoe_lab.server.threaded import start_service

SERVICE = {"model": {"name": "tiny-test", "preset": "tiny", "max_model_len": 256},
           "memory": {"max_num_seqs": 2, "block_size": 16, "cache_bytes": 2_000_000},
           "scheduler": {"max_batch_size": 3, "prefill_chunk_size": 64},
           "server": {"max_body_bytes": 8192}}
OK = {"model": "tiny-test", "prompt": "hi", "max_tokens": 2}

# (request body or raw bytes, path, expected param, expected code)
BAD = [
    (b"{not json", "completions", None, "invalid_json"),
    (b"\xff\xfe", "completions", None, "invalid_json"),
    (b"[" * 3000, "completions", None, "invalid_json"),
    ([1, 2], "completions", None, "invalid_type"),
    ({**OK, "prompt": "x" * 256}, "completions", "prompt", "context_length_exceeded"),
    ({**OK, "prompt": ""}, "completions", "prompt", "empty_prompt"),
    ({**OK, "prompt": []}, "completions", "prompt", "empty_prompt"),
    ({"model": "tiny-test"}, "completions", "prompt", "missing"),
    ({**OK, "prompt": [1, 99999]}, "completions", "prompt", "invalid_value"),
    ({**OK, "prompt": ["a", 5]}, "completions", "prompt", "invalid_type"),
    ({**OK, "prompt": ["a", ""]}, "completions", "prompt", "empty_prompt"),
    ({**OK, "prompt": ["a"] * 65}, "completions", "prompt", "invalid_value"),
    ({**OK, "max_tokens": 0}, "completions", "max_tokens", "invalid_value"),
    ({**OK, "max_tokens": "8"}, "completions", "max_tokens", "invalid_type"),
    ({**OK, "max_tokens": 2.5}, "completions", "max_tokens", "invalid_type"),
    ({**OK, "temperature": -1}, "completions", "temperature", "invalid_value"),
    ({**OK, "temperature": "hot"}, "completions", "temperature", "invalid_type"),
    ({**OK, "top_p": 0}, "completions", "top_p", "invalid_value"),
    ({**OK, "top_p": 1.5}, "completions", "top_p", "invalid_value"),
    ({**OK, "top_k": 0}, "completions", "top_k", "invalid_value"),
    ({**OK, "seed": -3}, "completions", "seed", "invalid_value"),
    ({**OK, "stop": 5}, "completions", "stop", "invalid_type"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "completions", "stop", "invalid_value"),
    ({**OK, "stream": "yes"}, "completions", "stream", "invalid_type"),
    ({**OK, "n": 0}, "completions", "n", "invalid_value"),
    ({**OK, "n": 17}, "completions", "n", "invalid_value"),
    ({**OK, "n": 3, "best_of": 2}, "completions", "best_of", "invalid_value"),
    ({**OK, "n": 2, "best_of": 3, "stream": True}, "completions", "best_of", "invalid_value"),
    ({**OK, "logprobs": 21}, "completions", "logprobs", "invalid_value"),
    ({**OK, "stop": "x" * 257}, "completions", "stop", "invalid_value"),
    ({**OK, "stop": ""}, "completions", "stop", "invalid_value"),
    ({**OK, "suffix": "x"}, "completions", "suffix", "unsupported_field"),
    ({**OK, "max_tokens": 255}, "completions", "max_tokens", "context_length_exceeded"),
    ({**OK, "seed": 2**64}, "completions", "seed", "invalid_value"),
    (b'{"model":"tiny-test","prompt":"hi","temperature":1e400}', "completions", "temperature", "invalid_value"),
    ({**OK, "presence_penalty": 2.5}, "completions", "presence_penalty", "invalid_value"),
    ({**OK, "logit_bias": {"99999": 1}}, "completions", "logit_bias", "invalid_value"),
    ({**OK, "logit_bias": {"5": 101}}, "completions", "logit_bias", "invalid_value"),
    ({**OK, "response_format": {"type": "json_object"}}, "completions", "response_format", "invalid_value"),
    ({**OK, "stream_options": {"include_usage": True}}, "completions", "stream_options", "invalid_value"),
    ({**OK, "user": 5}, "completions", "user", "invalid_type"),
    (b'{"model":"tiny-test","prompt":"a\\ud800b","max_tokens":2}', "completions", "prompt", "invalid_text"),
    (b'{"model":"tiny-test","prompt":"hi","max_tokens":1' + b"0" * 5000 + b"}", "completions", None, "invalid_json"),
    (b'{"model":"tiny-test","prompt":"hi","\\udfff":1}', "completions", "request body", "invalid_text"),
    ({**OK, "model": "gpt-4"}, "completions", "model", "model_not_found"),
    ({**OK, "model": 3}, "completions", "model", "invalid_type"),
    ({"model": "tiny-test", "prompt": "x" * 9000}, "completions", None, "body_too_large"),
    ({"model": "tiny-test", "messages": []}, "chat/completions", "messages", "empty_prompt"),
    ({"model": "tiny-test", "messages": "hi"}, "chat/completions", "messages", "invalid_type"),
    ({"model": "tiny-test", "messages": [{"role": "robot", "content": "x"}]}, "chat/completions",
     "messages[0].role", "invalid_value"),
    ({"model": "tiny-test", "messages": [{"role": "user", "content": 5}]}, "chat/completions",
     "messages[0].content", "invalid_type"),
    ({"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "tools": []}, "chat/completions",
     "tools", "unsupported_field"),
    ({"model": "tiny-test", "prompt": "x"}, "chat/completions", "prompt", "unsupported_field"),
    ({"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "echo": True}, "chat/completions",
     "echo", "unsupported_field"),
    ({"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat/completions",
     "top_logprobs", "invalid_value"),
    ({"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
      "max_completion_tokens": 2}, "chat/completions", "max_completion_tokens", "invalid_value"),
    (b'{"model":"tiny-test","messages":[{"role":"user","content":"a\\ud800"}]}', "chat/completions",
     "messages[0].content", "invalid_text"),
]


@pytest.fixture(scope="module")
def service():
    with start_service(SERVICE) as (served, worker):
        yield served, worker


HTTP = httpx.Client(timeout=60)  # one client: building one per call costs more than the request


def _post(url, path, body, **kwargs):
    if isinstance(body, bytes):
        return HTTP.post(f"{url}/v1/{path}", content=body, headers={"content-type": "application/json"}, **kwargs)
    return HTTP.post(f"{url}/v1/{path}", json=body, **kwargs)


@pytest.mark.parametrize("body, path, param, code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_400_naming_the_field(service, body, path, param, code):
    url = service[0].url
    response = _post(url, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param is None or param.split("[")[0] in error["message"]
    assert _post(url, "completions", OK).status_code == 200  # and the server still answers


def test_oversized_body_without_content_length(service):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    response = httpx.post(f"{service[0].url}/v1/completions", content=chunks())
    assert response.status_code == 400 and response.json()["error"]["code"] == "body_too_large"


def test_unknown_route_and_method_get_error_bodies(service):
    assert httpx.get(f"{service[0].url}/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(f"{service[0].url}/v1/completions").status_code == 405


def _wait_idle(url, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = HTTP.get(f"{url}/health").json()
        if health["running"] == health["waiting"] == health["blocks_used"] == health["slots_used"] == 0:
            return health
        time.sleep(0.1)
    raise AssertionError(f"not idle after {timeout} s: {health}")


def test_full_queue_gets_429_and_then_recovers(service):
    url = service[0].url
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    long = {"model": "tiny-test", "prompt": "busy", "max_tokens": 200, "temperature": 0}
    # max_batch_size = 3: two run (max_num_seqs = 2), one waits; create() returns once the engine accepted it
    streams = [client.completions.create(stream=True, **long) for _ in range(3)]
    try:
        health = HTTP.get(f"{url}/health").json()
        assert health["running"] + health["waiting"] == 3
        response = _post(url, "completions", OK)
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(**OK)
    finally:  # a failure here must not leave the queue full for the next tests
        for stream in streams:
            stream.close()
    _wait_idle(url)
    assert _post(url, "completions", OK).status_code == 200


def test_disconnecting_client_frees_its_blocks(service):
    url = service[0].url
    aborted_before = _counter(url, 'latentmoe_requests_finished_total{reason="abort"}')
    with httpx.stream("POST", f"{url}/v1/completions", json={**OK, "max_tokens": 200, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert HTTP.get(f"{url}/health").json()["blocks_used"] > 0
    _wait_idle(url)
    # non-streaming: a raw socket that sends the request and hangs up once it runs
    with socket.create_connection((service[0].host, service[0].port)) as sock:
        body = b'{"model": "tiny-test", "prompt": "bye", "max_tokens": 200}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while HTTP.get(f"{url}/health").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = HTTP.get(f"{url}/health").json()
        assert health["blocks_used"] > 0, health
    health = _wait_idle(url)
    assert health["blocks_used"] == 0 and health["slots_used"] == 0
    assert _counter(url, 'latentmoe_requests_finished_total{reason="abort"}') == aborted_before + 2


def test_garbage_does_not_stop_the_server(service):
    url = service[0].url
    for payload in (b"\x00" * 100, b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99\r\n\r\n{"):
        with socket.create_connection((service[0].host, service[0].port)) as sock:
            sock.sendall(payload)
    threads = [threading.Thread(target=_post, args=(url, "completions", b"{bad")) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _post(url, "completions", OK).status_code == 200


def _counter(url, line_prefix) -> float:
    for line in HTTP.get(f"{url}/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    return 0.0
