"""Prefill/decode disaggregation, the connector (docs/design.md §13.1): a prefill engine's request cache moves,
through the checksummed wire format, into a decode engine, which finishes the request with the tokens a
colocated engine and the model's own greedy decoding give; the decode pools hold the prefill side's bytes."""
import hashlib

import pytest
import torch

from disagg_cases import NEW_TOKENS, PARAMS, model, prompts, reference_tokens, run_1p1d, service  # noqa: F401
from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.logprobs import TokenLogprob
from latentmoe_lab.serving.transport import (NoRoomError, TransferError, bytes_per_request, decode, encode,
                                          export_request, held_requests, import_request, prefill_step,
                                          release_exported, transfer_bytes_by_kind, waiting_for_ack)
from latentmoe_lab.serving.transport.wire import payload_tensor_bytes
from latentmoe_lab.serving.service_plan import service_plan_text

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("kv_cache_dtype, speculative", [("auto", None), ("bf16", None), ("fp8", None),
                                                          ("fp8", NGRAM)])
def test_1p1d_equals_colocated_and_the_model(model, prompts, kv_cache_dtype, speculative):
    """With speculative decoding on both sides too: the decode side's sequences take their K spare slots."""
    colocated = Engine(model, service(kv_cache_dtype))
    expected = [o.token_ids for o in colocated.generate(prompts, PARAMS, use_tqdm=False)]
    if speculative is None:  # the fp8 case without drafts checks the same reference
        assert expected == [reference_tokens(model, p, kv_cache_dtype) for p in prompts]
    prefill, decode_engine = (Engine(model, service(kv_cache_dtype, speculative)),
                              Engine(model, service(kv_cache_dtype, speculative)))
    outputs, transfers = run_1p1d(prefill, decode_engine, prompts)
    assert [o.token_ids for o in outputs] == expected
    assert (decode_engine.stats()["spec_draft_tokens"] > 0) == (speculative is not None)  # drafts were verified
    assert prefill.scheduler.prefix_hit_tokens > 0  # the shared prefixes hit on the prefill side
    # the boundary rule: the prefill side computed every prompt token and decoded none; the decode side
    # recomputed nothing (its first step per request decodes the transferred first token)
    assert prefill.stats()["decode_tokens"] == 0 and decode_engine.stats()["prefill_tokens"] == 0
    if speculative is None:
        assert decode_engine.stats()["decode_tokens"] == len(prompts) * (NEW_TOKENS - 1)
    cache_dtype = service(kv_cache_dtype).cache_dtype
    for prompt_len, payload in transfers:  # planned == measured, per request
        assert payload_tensor_bytes(payload) == bytes_per_request(model.config, prompt_len, cache_dtype, "fp32")
    for engine in (prefill, decode_engine):  # drained: nothing held on either side
        assert engine.block_manager.blocks_used == 0 and engine.block_manager.slots_used == 0
    assert held_requests(prefill) == []


def test_sampled_requests_continue_their_generator(model, prompts):
    """Sampling (temperature 1, top-p, penalties, logprobs): the decode side draws from the generator state the
    prefill side left after the first token, so the tokens and logprobs equal the colocated engine's."""
    chosen = [prompts[i] for i in (1, 5, 10, 13)]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=7 + i, logprobs=2,
                             presence_penalty=0.5) for i in range(len(chosen))]
    colocated = Engine(model, service("fp8")).generate(chosen, params, use_tqdm=False)
    outputs, _ = run_1p1d(Engine(model, service("fp8")), Engine(model, service("fp8")), chosen, params=params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in colocated]
    greedy = [o.token_ids for o in Engine(model, service("fp8")).generate(chosen, PARAMS, use_tqdm=False)]
    assert [o.token_ids for o in outputs] != greedy  # the draws mattered
    for got, want in zip(outputs, colocated):
        assert [lp.token_id for lp in got.logprobs] == got.token_ids and len(got.logprobs) == NEW_TOKENS
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_host_tier_and_shared_indexer(prompts):
    """memory.offload (latent rows in a host tier with hot buffers) on both sides, and dsa.index_share_every 2
    (only the first of two DSA layers keeps index keys): the payload carries what the pools hold, no more."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny").replace(num_layers=8, dsa={"index_share_every": 2})
    model = LatentMoEForCausalLM(config).eval()
    chosen = [prompts[i] for i in (2, 6, 7, 15)]  # 16 .. 100 tokens: past the indexer's top-32
    offload = service("fp8", memory={"offload": {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 40}})
    expected = [o.token_ids for o in Engine(model, service("fp8")).generate(chosen, PARAMS, use_tqdm=False)]
    prefill, decode_engine = Engine(model, offload), Engine(model, offload)
    outputs, transfers = run_1p1d(prefill, decode_engine, chosen)
    assert [o.token_ids for o in outputs] == expected
    assert decode_engine.runner.pools.stats()["rows_moved"] > 0  # decodes read through the hot buffers
    for prompt_len, payload in transfers:
        cache = decode(payload)
        assert cache.dsa_latent.shape[0] == 2 and cache.dsa_index.shape[0] == 1
        assert payload_tensor_bytes(payload) == bytes_per_request(config, prompt_len, "fp8", "fp32")


def test_planned_bytes_full_scale():
    """k3-2.8t, a 1M-token request in fp8: 24 x (656 + 132) B per token + 69 KDA states of 96 x 128 x 128 fp32."""
    config, n = ModelConfig.from_preset("k3-2.8t"), 1_000_000
    kinds = transfer_bytes_by_kind(config, n, "fp8", "bf16")
    assert kinds["dsa_latent"] == 24 * 656 * n and kinds["dsa_index"] == 24 * 132 * n
    assert kinds["kda_state"] == 69 * 96 * 128 * 128 * 4
    assert kinds["kda_conv"] == 69 * 96 * (3 * 128) * (config.kda.conv_kernel - 1) * 2
    assert bytes_per_request(config, n, "fp8", "bf16") == sum(kinds.values())
    text = service_plan_text(ServiceConfig.from_yaml("configs/service-example.yaml"), config)  # plan-service
    assert "prefill -> decode transfer of one 1,000,000-token request (fp8 cache)" in text
    assert f"{'total':<18}{format_bytes(sum(kinds.values())):>14}" in text.split("prefill -> decode")[1]


def _one_cache(model, kv_cache_dtype="fp8", prompt=(5, 9, 13, 200, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)):
    engine = Engine(model, service(kv_cache_dtype))
    request = engine.add_request(list(prompt), PARAMS)
    caches = []
    while not caches:
        caches = prefill_step(engine)[1]
    return engine, request, caches[0]


def test_corrupted_payload_is_refused(model):
    _, _, cache = _one_cache(model)
    payload = encode(cache)
    restored = decode(payload)
    for name, tensor in cache.tensors().items():
        assert torch.equal(getattr(restored, name), tensor)
    assert restored.header() == cache.header()
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 0x01
    for bad in (bytes(flipped), payload[:-1], payload + b"\0", payload[:10]):
        with pytest.raises(TransferError, match="checksum|shorter"):
            decode(bad)
    # a well-formed checksum over a header that names a dtype outside the allow-list: refused, nothing unpickled
    body = payload[:-32].replace(b'"dtype":"float32"', b'"dtype":"object!"', 1)
    with pytest.raises(TransferError, match="kda_state: dtype 'object!' is not one of"):
        decode(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize("damage, message", [
    ("nan_logprob", r"^logprobs: a logprob must be a number <= 0"),
    ("positive_prompt_logprob", r"^prompt_logprobs: a logprob must be a number <= 0"),
    ("huge_kda_state", r"^kda_state: values must be finite and at most 1e\+06"),
    ("nan_conv_tail", r"^kda_conv: values must be finite"),
    ("zero_generator", r"^generator_state: not a state torch's generator takes"),
    ("ff_generator", r"^generator_state: not a state torch's generator takes"),
])
def test_a_correctly_signed_payload_with_garbage_values_is_refused(model, damage, message):
    """A buggy sender signs its garbage too: the values are checked, not only the checksum (they used to be
    imported, or to raise a RuntimeError that would end the decode instance)."""
    engine, _, cache = _one_cache(model)
    if damage == "nan_logprob":
        cache.logprobs = [TokenLogprob(cache.first_token, float("nan"))]
    elif damage == "positive_prompt_logprob":
        cache.prompt_logprobs = [TokenLogprob(5, 0.5)]
    elif damage == "huge_kda_state":
        cache.kda_state = torch.full_like(cache.kda_state, 1e30)
    elif damage == "nan_conv_tail":
        cache.kda_conv = torch.full_like(cache.kda_conv, float("nan"))
    else:
        cache.generator_state = torch.full_like(cache.generator_state, 0 if damage == "zero_generator" else 0xFF)
    received = decode(encode(cache))  # signed by the sender: the checksum holds
    decode_engine = Engine(model, service("fp8"))
    with pytest.raises(ValueError, match=message):
        import_request(decode_engine, received)
    assert decode_engine.block_manager.blocks_used == decode_engine.block_manager.slots_used == 0


def test_mismatched_checkpoint_or_cache_dtype_is_refused(model):
    _, _, cache = _one_cache(model, "fp8")
    with pytest.raises(ValueError, match=r"^memory.kv_cache_dtype: .*'fp8'.*'bf16'"):
        import_request(Engine(model, service("bf16")), cache)
    torch.manual_seed(1)
    other = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    with pytest.raises(ValueError, match=r"^model \(the checkpoint"):
        import_request(Engine(other, service("fp8")), cache)
    cache.kda_state = cache.kda_state[:, :1]  # a payload whose tensors do not fit its own prompt: named
    with pytest.raises(ValueError, match=r"^kda_state: expected \(3, 2, 16, 16\) torch.float32 for 18 tokens"):
        import_request(Engine(model, service("fp8")), cache)


def test_export_boundary_release_and_room(model):
    engine, request, cache = _one_cache(model)
    again = export_request(engine, request)  # a held request reads again (a resend)
    assert torch.equal(again.dsa_latent, cache.dsa_latent) and again.first_token == cache.first_token
    assert engine.block_manager.blocks_used > 0 and not engine.has_unfinished()
    release_exported(engine, request)
    assert engine.block_manager.blocks_used == 0 and engine.block_manager.slots_used == 0
    with pytest.raises(ValueError, match="request_id: request .* is not held"):
        release_exported(engine, request)
    waiting = engine.add_request([1, 2, 3], PARAMS)
    with pytest.raises(ValueError, match="request_id: no running request"):
        export_request(engine, waiting)
    decode_engine = Engine(model, service("fp8"))
    for _ in range(4):  # max_num_seqs 4: a fifth has no slot until one finishes
        import_request(decode_engine, cache)
    with pytest.raises(NoRoomError):
        import_request(decode_engine, cache)
    while decode_engine.has_unfinished():
        decode_engine.step()
    assert decode_engine.block_manager.blocks_used == 0 and decode_engine.block_manager.slots_used == 0


def test_held_requests_wait_for_the_ack(model):
    """Held requests keep their slots: with every slot held and nothing running the prefill engine waits for an
    ack (prefill_step does nothing rather than raise), and the next request runs once one is released."""
    engine = Engine(model, service("fp8"))
    for prompt in ([1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]):  # max_num_seqs 4: the fifth must wait
        engine.add_request(prompt, PARAMS)
    exported = []
    while len(exported) < 4:
        exported += prefill_step(engine)[1]
    assert waiting_for_ack(engine) and prefill_step(engine) == ([], [])
    release_exported(engine, exported[0].request_id)
    assert not waiting_for_ack(engine)
    assert [cache.prompt_ids for cache in prefill_step(engine)[1]] == [[11, 12]]
    for request in held_requests(engine):
        release_exported(engine, request)
    assert engine.block_manager.blocks_used == 0 and engine.block_manager.slots_used == 0
