"""The engine-level twin of the server's logprobs: prompt and generated logprobs equal log_softmax of
model(ids).logits computed whole in this process, under chunked prefill, prefix caching and preemption;
the OpenAI logit adjustments equal a plain loop (docs/design.md §6.6)."""
import random

import pytest
import torch

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.serving import Engine, SamplingParams
from latentmoe_lab.serving.planner import plan_cache
from latentmoe_lab.serving.sampling import adjusted_logits

TOL = 1e-5
SERVICE = {"model": {"name": "t", "preset": "tiny", "max_model_len": 256},
           "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 4_000_000, "prefix_cache": {}},
           "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 24}}


@pytest.fixture(scope="module")
def model():
    return load_model(split_service_dict(SERVICE)[0])


def _engine(model, blocks=None):
    """An engine on SERVICE; blocks: pools of exactly that many blocks (8 of 16 tokens hold one 128-token
    sequence, so three force preemptions)."""
    config, _ = split_service_dict(SERVICE)
    if blocks is not None:
        plan = plan_cache(model.config, config)
        budget = plan.pool_rows * plan.slot_bytes + blocks * plan.block_bytes
        config, _ = split_service_dict({**SERVICE, "model": {**SERVICE["model"], "max_model_len": 128},
                                        "memory": {**SERVICE["memory"], "cache_bytes": budget}})
    return Engine(model, config)


def _reference(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(model, prompt, out, k):
    ids = prompt + out.token_ids
    reference = _reference(model, ids)
    scored = out.prompt_logprobs + out.logprobs  # positions 0 .. len(ids) - 2 score tokens 1 .. len(ids) - 1
    assert [lp.token_id for lp in scored] == ids[1:]
    assert torch.allclose(torch.tensor([lp.logprob for lp in scored]),
                          reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=TOL)
    for position, lp in enumerate(scored):
        values, indices = torch.topk(reference[position], k)
        assert [i for i, _ in lp.top] == indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), values, atol=TOL)


def test_logprobs_equal_the_whole_forward_under_chunks_and_prefix_hits(model):
    engine = _engine(model)
    prompt = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n")  # > 2 blocks, 3 chunks
    warm = engine.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]  # fills the prefix cache
    assert warm.finish_reason == "length"
    hits = engine.stats()["prefix_hit_tokens"]
    scored, sampled = engine.generate([prompt, prompt], [SamplingParams(max_tokens=0, prompt_logprobs=3),
                                                         SamplingParams(max_tokens=6, temperature=0.8, seed=1,
                                                                        logprobs=3, prompt_logprobs=3)],
                                      use_tqdm=False)
    assert engine.stats()["prefix_hit_tokens"] == hits  # prompt logprobs need every position to run
    assert scored.token_ids == [] and scored.finish_reason == "length" and len(scored.prompt_logprobs) == len(prompt) - 1
    _check(model, prompt, scored, 3)
    _check(model, prompt, sampled, 3)
    plain = engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and engine.stats()["prefix_hit_tokens"] > hits
    assert engine.stats()["blocks_used"] == engine.stats()["slots_used"] == 0


def test_logprobs_survive_preemption_without_repeats(model):
    engine = _engine(model, blocks=8)
    assert engine.plan.num_blocks == 8
    prompts = [list(f"{i}: the quick brown fox jumps over the lazy dog".encode()) for i in range(3)]
    params = SamplingParams(max_tokens=20, logprobs=1, prompt_logprobs=1)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats()["preemptions"] > 0, "the pools are sized to force a preemption"
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) and len(out.prompt_logprobs) == len(prompt) - 1
        _check(model, prompt, out, 1)


def test_logit_adjustments_equal_a_plain_loop():
    rng = random.Random(0)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    generated = [rng.randrange(50) for _ in range(30)]
    bias = ((3, 5.0), (7, -100.0), (3 + 10, 0.5))
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, logit_bias=bias, temperature=1.0)
    expected = logits.tolist()
    for token, value in bias:
        expected[token] += value
    for token in set(generated):
        expected[token] -= 0.7 + (-0.3) * generated.count(token)
    assert torch.allclose(adjusted_logits(logits, params, generated), torch.tensor(expected), atol=1e-6)
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=5e-324).greedy


@pytest.mark.parametrize("field, value, rule", [("seed", 2**64, r"\[0, 2\^64\)"), ("logprobs", 21, r"\[0, 20\]"),
                                                ("presence_penalty", 2.5, r"\[-2, 2\]"),
                                                ("logit_bias", ((1, 101.0),), r"\[-100, 100\]"),
                                                ("max_tokens", -1, ">= 0")])
def test_sampling_params_refuse_out_of_range_values(field, value, rule):
    with pytest.raises(ValueError, match=f"^{field}: .*{rule}"):
        SamplingParams(**{field: value})
