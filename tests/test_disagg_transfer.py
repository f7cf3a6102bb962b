"""Prefill/decode disaggregation, the connector (docs/design.md §13.1): a prefill engine's request cache moves,
through the checksummed wire format, into a decode engine, which finishes the request with the tokens a
colocated engine and the model's own greedy decoding give; the decode pools hold the prefill side's bytes."""
import hashlib

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.paged_pools import DSAPool, KDAPool
from latentmoe_lab.quant.kv_cache import quantized_kv_cache
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.disagg import (NoRoomError, TransferError, bytes_per_request, decode, encode,
                                          export_request, held_requests, held_sequence, import_request, prefill_step,
                                          release_exported, transfer_bytes_by_kind, waiting_for_ack)
from latentmoe_lab.serving.disagg.pool_rows import flat_positions
from latentmoe_lab.serving.disagg.tp_rows import gather_heads, slice_heads
from latentmoe_lab.serving.disagg.wire import payload_tensor_bytes
from latentmoe_lab.serving.service_plan import service_plan_text

NEW_TOKENS = 6
PARAMS = SamplingParams(max_tokens=NEW_TOKENS)


def service(kv_cache_dtype: str = "auto", speculative: dict | None = None, memory: dict | None = None,
            **parallel) -> ServiceConfig:
    return ServiceConfig.from_dict({
        "model": {"preset": "tiny", "max_model_len": 256},
        "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000, "enable_prefix_caching": True,
                   "kv_cache_dtype": kv_cache_dtype} | (memory or {}),
        "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 32}} | ({"parallel": parallel} if parallel else {})
        | ({"speculative": speculative} if speculative else {}))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def prompts():
    """16 ragged prompts: 1 token, around a block (16) and a chunk (32), and shared prefixes (prefix-cache hits)."""
    base = torch.randint(0, 250, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    other = torch.randint(0, 250, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    return ([base[:n] for n in (1, 15, 16, 17, 33, 48, 64, 100)]
            + [other[:n] for n in (2, 5, 31, 32, 40, 47, 65, 80)])


def reference_tokens(model, prompt: list[int], kv_cache_dtype: str) -> list[int]:
    """model.generate (fp32 cache) or, for a stored format, the model's greedy loop over its codec twin."""
    ids = torch.tensor([prompt])
    if kv_cache_dtype == "auto":
        return model.generate(ids, NEW_TOKENS)[0, len(prompt):].tolist()
    cache, tokens = quantized_kv_cache(model.config, kv_cache_dtype, "fp32"), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(ids if not tokens else ids[:, -1:], cache=cache).logits[0, -1]
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens


def assert_pools_equal(prefill, prefill_seq, decode_engine, decode_seq) -> None:
    """Per layer: the decode side's rows == the prefill side's, bitwise (DSA storage bytes and what the format
    reads back from them; KDA state and conv tail)."""
    n = len(prefill_seq.prompt_ids)
    src = flat_positions(prefill_seq.block_table, prefill.block_manager.block_size, n)
    dst = flat_positions(decode_seq.block_table, decode_engine.block_manager.block_size, n)
    for a, b in zip(prefill.pools.layers, decode_engine.pools.layers):
        if isinstance(a, DSAPool):
            for got, want in zip(b.read(dst), a.read(src)):  # index keys: None in a layer sharing another's
                assert (got is None and want is None) or torch.equal(got, want)
        else:
            assert isinstance(a, KDAPool)
            assert torch.equal(b.state[decode_seq.slot], a.state[prefill_seq.slot])
            assert torch.equal(b.conv[decode_seq.slot], a.conv[prefill_seq.slot])


def run_1p1d(prefill: Engine, decode_engine: Engine, prompts, check_pools: bool = True,
             params: list[SamplingParams] | None = None) -> tuple[list, list]:
    """Every prompt through prefill -> encode -> decode -> decode engine; (finished output per prompt, transfers
    as (prompt length, payload bytes)). Acks (release) only after the import succeeded."""
    params = params or [PARAMS] * len(prompts)
    index_of = {prefill.add_request(p, q): i for i, (p, q) in enumerate(zip(prompts, params))}
    finished, transfers, pending, decode_index = [None] * len(prompts), [], [], {}
    while prefill.has_unfinished() or decode_engine.has_unfinished() or pending:
        if prefill.has_unfinished():
            outputs, caches = prefill_step(prefill)
            assert not any(o.finished for o in outputs)  # max_tokens 6: nobody ends at its first token
            pending += caches
        while pending:
            payload = encode(pending[0])
            try:
                decode_id = import_request(decode_engine, decode(payload))
            except NoRoomError:
                break
            cache = pending.pop(0)
            transfers.append((cache.num_tokens, payload))
            if check_pools:
                assert_pools_equal(prefill, held_sequence(prefill, cache.request_id), decode_engine,
                                   decode_engine._sequences[decode_id])
            release_exported(prefill, cache.request_id)
            decode_index[decode_id] = index_of[cache.request_id]
        if decode_engine.has_unfinished():
            for out in decode_engine.step():
                if out.finished:
                    assert out.finish_reason == "length"
                    finished[decode_index[out.request_id]] = out
    return finished, transfers


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
    cache_dtype = service(kv_cache_dtype).cache_dtype
    for prompt_len, payload in transfers:  # planned == measured, per request
        assert payload_tensor_bytes(payload) == bytes_per_request(model.config, prompt_len, cache_dtype, "fp32")
    for engine in (prefill, decode_engine):  # drained: nothing held on either side
        assert engine.block_manager.blocks_used == 0 and engine.block_manager.slots_used == 0
    assert held_requests(prefill) == []


def test_tp2_prefill_to_tp1_decode(model, prompts):
    """A tensor-parallel prefill's KDA heads are gathered from its two ranks; a TP1 decode finishes the requests."""
    chosen = [prompts[i] for i in (0, 11, 14)]
    expected = [o.token_ids for o in Engine(model, service("fp8")).generate(chosen, PARAMS, use_tqdm=False)]
    prefill = Engine(model, service("fp8", tensor_parallel_size=2))
    try:
        outputs, transfers = run_1p1d(prefill, Engine(model, service("fp8")), chosen, check_pools=False)
        assert prefill.block_manager.blocks_used == 0 and prefill.block_manager.slots_used == 0
    finally:
        prefill.close()
    assert [o.token_ids for o in outputs] == expected
    # the gathered state is the one-process state up to the TP reductions' rounding (a misplaced head is O(1))
    one = Engine(model, service("fp8"))
    request = one.add_request(chosen[2], PARAMS)
    while not one._sequences[request].generated_ids:
        one.step()
    alone = export_request(one, request)
    gathered = next(decode(payload) for n, payload in transfers if n == len(chosen[2]))
    torch.testing.assert_close(gathered.kda_state, alone.kda_state, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gathered.kda_conv, alone.kda_conv, atol=1e-5, rtol=1e-4)
    release_exported(one, request)


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
    assert decode_engine.pools.stats()["rows_moved"] > 0  # decodes read through the hot buffers
    for prompt_len, payload in transfers:
        cache = decode(payload)
        assert cache.dsa_latent.shape[0] == 2 and cache.dsa_index.shape[0] == 1
        assert payload_tensor_bytes(payload) == bytes_per_request(config, prompt_len, "fp8", "fp32")


def test_tp1_prefill_to_tp2_decode(model, prompts):
    """The other way: each decode rank gets its KDA heads (and conv channels) sliced from the payload."""
    chosen = [prompts[i] for i in (3, 9, 15)]
    expected = [o.token_ids for o in Engine(model, service("bf16")).generate(chosen, PARAMS, use_tqdm=False)]
    decode_engine = Engine(model, service("bf16", tensor_parallel_size=2))
    try:
        outputs, _ = run_1p1d(Engine(model, service("bf16")), decode_engine, chosen, check_pools=False)
        assert decode_engine.block_manager.blocks_used == 0 and decode_engine.block_manager.slots_used == 0
    finally:
        decode_engine.close()
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("parts", [2, 4])
def test_heads_slice_and_gather_are_inverse(parts):
    """The whole-model rows -> every tp rank's share -> gathered back: the same tensors; a rank's KDA conv
    share is its heads' q, k and v channels (the layout of parallel/tensor.py shard_kda)."""
    heads, d_k, d_v, generator = 4, 3, 5, torch.Generator().manual_seed(parts)
    rows = {"dsa_latent": torch.randint(0, 255, (2, 7, 9), dtype=torch.uint8, generator=generator),
            "dsa_index": torch.randint(0, 255, (2, 7, 6), dtype=torch.uint8, generator=generator),
            "kda_state": torch.randn(3, heads, d_k, d_v, generator=generator),
            "kda_conv": torch.randn(3, heads * (2 * d_k + d_v), 2, generator=generator)}
    shares = [slice_heads(rows, index, parts, d_k, d_v) for index in range(parts)]
    gathered = gather_heads(shares, d_k, d_v)
    for name, tensor in rows.items():
        assert torch.equal(gathered[name], tensor)
    local = heads // parts
    q, k, v = rows["kda_conv"].split([heads * d_k, heads * d_k, heads * d_v], dim=1)
    last = shares[-1]["kda_conv"]
    assert torch.equal(last[:, :local * d_k], q[:, -local * d_k:])
    assert torch.equal(last[:, local * d_k:2 * local * d_k], k[:, -local * d_k:])
    assert torch.equal(last[:, 2 * local * d_k:], v[:, -local * d_v:])
    with pytest.raises(ValueError, match="parallel.tensor_parallel_size: \\(3\\) must divide the KDA heads"):
        slice_heads(rows, 0, 3, d_k, d_v)


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
