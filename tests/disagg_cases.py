"""What the disaggregation connector's tests share: a small paged service, 16 ragged prompts, the reference
tokens, a bitwise comparison of two engines' pools, and an in-process 1P1D loop (docs/design.md §13.1)."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.paged_pools import DSAPool, KDAPool
from latentmoe_lab.quant.kv_cache import quantized_kv_cache
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.transport import (NoRoomError, decode, encode, held_sequence, import_request, prefill_step,
                                          release_exported)
from latentmoe_lab.serving.transport.pool_rows import flat_positions

NEW_TOKENS = 6
PARAMS = SamplingParams(max_tokens=NEW_TOKENS)


def service(kv_cache_dtype: str = "auto", speculative: dict | None = None, memory: dict | None = None,
            **parallel) -> ServiceConfig:
    return ServiceConfig.from_dict({
        "model": {"preset": "tiny", "max_model_len": 256},
        "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000, "prefix_cache": {},
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
    for a, b in zip(prefill.runner.pools.layers, decode_engine.runner.pools.layers):
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
                                   decode_engine.sequence(decode_id))
            release_exported(prefill, cache.request_id)
            decode_index[decode_id] = index_of[cache.request_id]
        if decode_engine.has_unfinished():
            for out in decode_engine.step():
                if out.finished:
                    assert out.finish_reason == "length"
                    finished[decode_index[out.request_id]] = out
    return finished, transfers
