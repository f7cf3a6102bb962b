"""The HTTP service through the official openai client: same tokens as Engine.generate, concurrency, API key,
/metrics, a killed forward process (docs/design.md §10).

The service runs its forward in a worker process (parallel.forward_process, as configs/service-cpu.yaml
does); the reference is Engine.generate with the forward in this process."""
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving import Engine, SamplingParams
from latentmoe_lab.tokenizer import ByteTokenizer

KEY = "test-key"
SERVICE = {"model": {"name": "tiny-test", "preset": "tiny", "max_model_len": 512},
           "parallel": {"forward_process": True},
           "memory": {"max_num_seqs": 16, "block_size": 16, "cache_bytes": 4_000_000, "prefix_cache": {}},
           "scheduler": {"max_batch_size": 128, "prefill_chunk_size": 96}}
PROMPTS = ["Hello, world", "a", "The quick brown fox jumps over the lazy dog " * 3, "é ü 漢字"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def service():
    with start_service(SERVICE, api_key=KEY) as (served, worker):
        yield served, worker


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    """Engine.generate in process, on the same weights: prompt text -> generated ids (greedy)."""
    config, _ = split_service_dict({**SERVICE, "parallel": {"forward_process": False}})
    engine = Engine(load_model(config), config)
    chat_prompt = "<|user|>\nHello, world\n<|assistant|>\n"
    prompts = PROMPTS + [chat_prompt]
    outs = engine.generate([list(p.encode()) for p in prompts], SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    return {p: out.token_ids for p, out in zip(prompts, outs)}


def test_completions_equal_engine_generate(client, reference):
    decode = ByteTokenizer(512).decode
    for prompt in PROMPTS:
        result = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        choice = result.choices[0]
        assert choice.model_extra["token_ids"] == reference[prompt]
        assert choice.text == decode(reference[prompt])
        assert choice.finish_reason == "length"
        assert result.usage.completion_tokens == NEW_TOKENS and result.usage.prompt_tokens == len(prompt.encode())


def test_streaming_equals_engine_generate(client, reference):
    decode = ByteTokenizer(512).decode
    for prompt in PROMPTS:
        chunks = list(client.completions.create(model="tiny-test", prompt=prompt, max_tokens=NEW_TOKENS,
                                                temperature=0, stream=True))
        ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
        assert ids == reference[prompt]
        assert "".join(c.choices[0].text for c in chunks) == decode(reference[prompt])
        assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_and_not_equal_engine_generate(client, reference):
    expected = reference["<|user|>\nHello, world\n<|assistant|>\n"]
    messages = [{"role": "user", "content": "Hello, world"}]
    full = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert full.choices[0].model_extra["token_ids"] == expected
    assert full.choices[0].message.content == ByteTokenizer(512).decode(expected)
    chunks = list(client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_stop_string_and_seeded_sampling(client, reference):
    prompt = PROMPTS[0]
    text = ByteTokenizer(512).decode(reference[prompt])
    stop = next(ch for ch in text[2:] if ch.isascii() and ch.isprintable())  # a character it will reach
    result = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                       stop=[stop])
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-test", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=[stop], stream=True))
    assert streamed == result.choices[0].text
    sampled = [client.completions.create(model="tiny-test", prompt=prompt, max_tokens=8, temperature=1.0, seed=7)
               .choices[0].model_extra["token_ids"] for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_64_concurrent_clients(client, reference):
    results, errors = {}, []

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            stream = i % 2 == 1
            out = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=stream)
            ids = [t for c in out for t in c.choices[0].model_extra["token_ids"]] if stream else \
                out.choices[0].model_extra["token_ids"]
            results[i] = ids == reference[prompt]
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(error))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert len(results) == 64 and all(results.values())


def test_api_key_enforced(service):
    url = service[0].url
    body = {"model": "tiny-test", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-test"]


def _metrics(url) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_parse_and_move(service, client):
    url = service[0].url
    before = _metrics(url)
    client.completions.create(model="tiny-test", prompt="metrics please", max_tokens=5, temperature=0)
    httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    after = _metrics(url)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("latentmoe_generation_tokens_total") == 5
    assert moved("latentmoe_time_to_first_token_seconds_count") == 1
    assert moved("latentmoe_inter_token_latency_seconds_count") == 4
    assert moved("latentmoe_e2e_request_latency_seconds_count") == 1
    assert moved("latentmoe_requests_finished_total", (("reason", "length"),)) == 1
    assert moved("latentmoe_request_errors_total", (("kind", "model_not_found"),)) == 1
    for name in ("latentmoe_kv_blocks_free", "latentmoe_kda_slots_free", "process_resident_memory_bytes"):
        assert after[(name, ())] > 0
    assert after[("latentmoe_kv_blocks_used", ())] == 0 and after[("latentmoe_kda_slots_used", ())] == 0
    assert ("latentmoe_engine_restarts_total", (("cause", "worker_died"),)) in after
    assert ("latentmoe_request_retries_total", ()) in after and ("latentmoe_preemptions_total", ()) in after


def test_echo_logprobs_through_the_forward_process(client):
    """Prompt logits come back from the worker process (ForwardBatch.logits_index on the wire)."""
    import torch

    prompt = PROMPTS[2]
    ids = list(prompt.encode())
    choice = client.completions.create(model="tiny-test", prompt=prompt, echo=True, logprobs=1, max_tokens=0).choices[0]
    config, _ = split_service_dict({**SERVICE, "parallel": {"forward_process": False}})
    with torch.no_grad():
        logp = torch.log_softmax(load_model(config)(torch.tensor([ids])).logits[0], dim=-1)
    expected = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs[1:]), expected, atol=1e-5)


def test_health_says_unavailable_while_the_forward_process_is_stopped(service):
    url, worker = service[0].url, service[1]
    pid = worker.engine.runner.pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline, health = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            health = httpx.get(f"{url}/health")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["reason"] == f"forward worker rank 0 (pid {pid}) stopped"
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").status_code == 200


def test_killed_forward_process_is_invisible_to_clients(service, client, reference):
    """kill -9 of the forward process mid-generation: the engine starts a fresh one and recomputes; every
    stream completes and equals Engine.generate."""
    worker = service[1]
    pid = worker.engine.runner.pids[0]
    results, errors = {}, []

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            chunks = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=NEW_TOKENS,
                                               temperature=0, stream=True)
            results[i] = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == reference[prompt]
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(error))

    decoded = worker.last_stats["decode_tokens"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while worker.last_stats["decode_tokens"] == decoded and time.monotonic() < deadline:
        time.sleep(0.01)  # kill once these requests decode
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(results) == 8 and all(results.values())
    assert worker.engine.stats()["worker_restarts"] >= 1 and worker.engine.runner.pids[0] != pid
