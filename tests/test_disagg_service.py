"""The disaggregated service (docs/design.md §13.2): one prefill and one decode instance process behind the
OpenAI endpoint. Through the official openai client, greedy outputs equal a colocated Engine and
model.generate; the three faults (a prefill instance killed mid-transfer, a decode instance killed with
requests running, a corrupted payload) leave every output unchanged and nothing held; bad role configs are
refused at start-up with the key path named."""
import threading

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import load_service_file, split_service_dict
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving import Engine, SamplingParams
from latentmoe_lab.serving.disagg.instance import InstanceFaults

BASE = {"model": {"name": "tiny-pd", "preset": "tiny", "max_model_len": 512},
        "parallel": {"forward_threads": 1},
        "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 4_000_000, "prefix_cache": {}},
        "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 96}}
SERVICE = {**BASE, "disaggregation": {"prefill_instances": 1, "decode_instances": 1, "transport": "pipe",
                                      "decode": {"memory": {"cache_bytes": 6_000_000}}}}
PROMPTS = ["Hello, world", "a", "The quick brown fox jumps over the lazy dog " * 4, "é ü 漢字", "x" * 150,
           "0123456789" * 3]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    """prompt -> greedy ids from a colocated Engine, checked against model.generate."""
    config, _ = split_service_dict(BASE)
    model = load_model(config)
    outs = Engine(model, config).generate([list(p.encode()) for p in PROMPTS], SamplingParams(max_tokens=NEW_TOKENS),
                                          use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([list(prompt.encode())])
        assert model.generate(ids, NEW_TOKENS)[0, ids.shape[1]:].tolist() == out.token_ids
    return {p: out.token_ids for p, out in zip(PROMPTS, outs)}


SCORE = {"model": "tiny-pd", "prompt": "import os\nimport sys\n", "max_tokens": 0, "echo": True, "logprobs": 1}


@pytest.fixture(scope="module")
def colocated_score():
    """The colocated server's answer to SCORE: the prompt with its logprobs (echo + max_tokens 0 scores it)."""
    with start_service(BASE) as (served, _):
        reply = httpx.post(served.url + "/v1/completions", json=SCORE, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def _scores_the_prompt_as_colocated(url: str, colocated: dict) -> None:
    """echo + max_tokens 0 + logprobs through P/D: the prompt's logprobs, as the colocated server gives them
    (it used to answer 200 with an empty text, tokens and logprobs)."""
    reply = httpx.post(url + "/v1/completions", json=SCORE, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == colocated["text"] == SCORE["prompt"]
    ours, theirs = choice["logprobs"], colocated["logprobs"]
    assert ours["tokens"] == theirs["tokens"] and len(ours["tokens"]) == len(SCORE["prompt"])
    assert ours["text_offset"] == theirs["text_offset"]
    assert ours["token_logprobs"][0] is None and theirs["token_logprobs"][0] is None
    assert ours["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=1e-5)


def _complete_all(url: str, stream_index: int | None = None) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    results = {}

    def one(prompt, stream):
        if stream:
            chunks = client.completions.create(model="tiny-pd", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                               stream=True)
            results[prompt] = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
        else:
            result = client.completions.create(model="tiny-pd", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            results[prompt] = result.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=one, args=(p, i == stream_index)) for i, p in enumerate(PROMPTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    return results


def _drained(url: str) -> dict:
    """/health once every instance reported its last release (blocks and slots summed over the instances)."""
    for _ in range(100):
        health = httpx.get(url + "/health", timeout=10).json()
        if health["in_flight"] == 0 and health["blocks_used"] == 0 and health["slots_used"] == 0 \
                and health["held"] == 0:
            break
        threading.Event().wait(0.1)
    return health


def _metric(url: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_one_endpoint_over_1p1d_equals_colocated_and_generate(reference, colocated_score):
    with start_service(SERVICE) as (served, worker):
        _scores_the_prompt_as_colocated(served.url, colocated_score)
        results = _complete_all(served.url, stream_index=2)
        health = _drained(served.url)
        assert results == reference
        assert health["status"] == "ok" and health["blocks_used"] == 0 and health["slots_used"] == 0
        assert health["held"] == 0 and health["in_flight"] == 0
        router = worker.router
        assert router.counts["transfers"] == len(PROMPTS)  # each one transferred once, none refused
        assert router.counts["refused"] == router.counts["recomputed"] == 0
        assert _metric(served.url, "latentmoe_transfer_bytes_total") == router.counts["transfer_bytes"] > 0
        assert _metric(served.url, "latentmoe_transfer_seconds_count") == len(PROMPTS)
        assert _metric(served.url, "latentmoe_role_time_to_first_token_seconds_count", role="prefill",
                       instance="prefill0") == len(PROMPTS)
        assert _metric(served.url, "latentmoe_role_time_per_output_token_seconds_count", role="decode",
                       instance="decode0") == len(PROMPTS)
        for role in ("prefill", "decode"):
            assert _metric(served.url, "latentmoe_instance_queue_depth", role=role, instance=f"{role}0") == 0
        decode = next(i for i in router.all_instances() if i.spec.role == "decode")
        assert decode.stats["decode_tokens"] > 0 and decode.stats["prefill_tokens"] == 0  # decode never prefilled
        _aborts_free_everything(served.url, worker)


def _aborts_free_everything(url: str, worker) -> None:
    """Requests aborted before their prefill, between prefill and decode, and while decoding end with
    "abort", and both instances give every block, slot and held transfer back."""
    ends, first = {}, {}

    def deliver(index):
        def on_event(event):
            if event.token_ids:
                first.setdefault(index, threading.Event()).set()
            if event.finished:
                ends[index] = event.finish_reason
        return on_event

    params = SamplingParams(max_tokens=200)
    keys = [worker.submit(list(b"abort me %d " % i) * 8, params, deliver(i)).result(timeout=30) for i in range(3)]
    worker.abort(keys[0])  # most likely still waiting on the prefill instance
    for index in (1, 2):
        assert first.setdefault(index, threading.Event()).wait(60)
    worker.abort(keys[1])
    threading.Event().wait(0.5)  # a few decode steps
    worker.abort(keys[2])
    health = _drained(url)
    assert ends == {0: "abort", 1: "abort", 2: "abort"}
    assert health["blocks_used"] == health["slots_used"] == health["held"] == health["in_flight"] == 0


@pytest.mark.slow
def test_a_tp2_prefill_instance_hands_over_to_a_tp1_decode_instance(reference):
    """The prefill instance's forward on 2 tensor-parallel worker processes (its own children), the decode
    instance's in its process: the KDA heads are gathered on export (§13.1), outputs unchanged."""
    tp2 = {**SERVICE, "disaggregation": {**SERVICE["disaggregation"],
                                         "prefill": {"parallel": {"tensor_parallel_size": 2}}}}
    with start_service(tp2) as (served, worker):
        assert _complete_all(served.url) == reference
        assert _drained(served.url)["blocks_used"] == 0
        assert worker.router.counts["transfers"] == len(PROMPTS)


FAULTS = {"prefill0": InstanceFaults(corrupt_transfer=1, exit_mid_transfer=3),
          "decode0": InstanceFaults(exit_at_decode_step=6)}


@pytest.fixture(scope="module")
def faulted(reference):
    """One run with all three faults: the prefill instance's first payload is corrupted (refused, sent again), it
    dies half way through its third send; the decode instance dies before its 6th step, requests running."""
    with start_service(SERVICE, faults=FAULTS) as (served, worker):
        results = _complete_all(served.url)
        health = _drained(served.url)
        yield results, health, worker.router, served.url


def test_a_corrupted_transfer_is_refused_and_sent_again(faulted, reference):
    results, _, router, url = faulted
    assert results == reference
    assert router.counts["refused"] >= 1 and _metric(url, "latentmoe_transfers_refused_total") >= 1


def test_a_prefill_instance_killed_mid_transfer_loses_no_request(faulted, reference):
    results, _, router, url = faulted
    assert results == reference  # every request completed, outputs those of the unfaulted run
    assert router.restarts["prefill"] == 1 and _metric(url, "latentmoe_instance_restarts_total", role="prefill") == 1
    assert router.counts["recomputed"] >= 1


def test_a_decode_instance_killed_recomputes_its_running_requests(faulted, reference):
    results, _, router, url = faulted
    assert results == reference
    assert router.restarts["decode"] == 1 and _metric(url, "latentmoe_instance_restarts_total", role="decode") == 1


def test_nothing_is_held_on_either_side_after_the_faults_drain(faulted):
    _, health, router, _ = faulted
    assert health["status"] == "ok" and health["in_flight"] == 0
    for instance in router.all_instances():  # the restarted processes, which took the recomputes
        assert instance.stats["blocks_used"] == instance.stats["slots_used"] == instance.stats["held"] == 0, \
            instance.name


def _write(tmp_path, disaggregation: dict) -> str:
    import yaml

    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump({**BASE, "disaggregation": {"prefill_instances": 1, "decode_instances": 1,
                                                               **disaggregation}}))
    return str(path)


@pytest.mark.parametrize("overrides, message", [
    ({"decode": {"memory": {"cache_bytes": 60_000}}}, "disaggregation.decode.memory.cache_bytes:"),
    ({"decode": {"memory": {"kv_cache_dtype": "bf16"}}}, "disaggregation.decode.memory.kv_cache_dtype:"),
    ({"prefill": {"memory": {"kv_cache_dtype": "fp8"}}}, "disaggregation.prefill.memory.kv_cache_dtype:"),
    ({"prefill": {"model": {"seed": 1}}}, "disaggregation.prefill.model.seed:"),
    ({"decode": {"model": {"preset": "small"}}}, "disaggregation.decode.model.preset:"),
    ({"decode": {"parallel": {"role": "prefill"}}}, "disaggregation.decode.parallel.role:"),
    ({"decode": {"serve": {}}}, "disaggregation.decode.serve:"),
    ({"transport": "tcp"}, "disaggregation.transport:"),
    ({"decode_instances": 0}, "disaggregation.decode_instances:"),
    # sizes this host cannot hold, refused before any instance allocates (they used to pass the check)
    ({"decode": {"memory": {"cache_bytes": 10**15}}}, "disaggregation.decode.memory.cache_bytes: 1000000000000000"),
    ({"prefill_instances": 10**6}, "disaggregation.prefill_instances: at most 64"),
])
def test_a_role_config_that_cannot_work_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_service_file(_write(tmp_path, overrides))


def test_instances_whose_pools_together_exceed_the_host_are_refused(tmp_path):
    """Each instance's pools fit alone; 64 of them do not."""
    from latentmoe_lab.serving.host_limits import available_memory_bytes

    each = available_memory_bytes() // 32
    with pytest.raises(ValueError, match=r"disaggregation\.prefill_instances: 64 prefill \+ 1 decode instance "
                                         r"processes hold .* more than the .* available on this host"):
        load_service_file(_write(tmp_path, {"prefill_instances": 64, "prefill": {"memory": {"cache_bytes": each}}}))


def test_roles_whose_cache_formats_resolve_alike_are_accepted(tmp_path):
    """kv_cache_dtype auto on fp32 weights stores fp32: a decode override spelling it out is the same format."""
    config, _ = load_service_file(_write(tmp_path, {"decode": {"memory": {"kv_cache_dtype": "fp32"}}}))
    assert config.disaggregation.decode == {"memory": {"kv_cache_dtype": "fp32"}}


def test_a_role_without_the_disaggregation_section_is_refused(tmp_path):
    from latentmoe_lab.serving import ServiceConfig

    with pytest.raises(ValueError, match=r"parallel\.role: 'decode' needs the disaggregation: section"):
        ServiceConfig.from_dict({**BASE, "parallel": {"role": "decode"}})


def test_the_shipped_pd_service_file_loads():
    config, _ = load_service_file("configs/service-cpu-pd.yaml")
    assert (config.disaggregation.prefill_instances, config.disaggregation.decode_instances) == (1, 1)
