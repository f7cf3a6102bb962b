"""What a seeded sampled request's tokens depend on under speculative decoding (serving/spec/speculator.py).

The seed, the prompt, the params and the logits; not what the engine served before. It used to hang on the
MTP drafter's state: after a prefix hit the drafter had no hidden rows and proposed nothing, a request
without drafts draws differently, and 0 of 8 seeds gave the same text fresh and after an unrelated request
warmed the prefix cache. And a P/D prefill instance with a `speculative:` section decoded requests itself
(a verify step emits several tokens, which are not handed over). scheduler.batch_invariant makes the
logits bit-identical however requests are batched, chunked or hit the cache (docs/design.md §6.5).
"""
import pytest
import torch

from disagg_cases import run_1p1d
from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.disagg.section import role_config

PROMPT = torch.randint(0, 250, (140,), generator=torch.Generator().manual_seed(4)).tolist()
OTHER = PROMPT[:130] + [7, 8, 9, 10, 11]  # shares 2 blocks of 64 with PROMPT: a prefix hit for it
SPECS = {"mtp-K3": {"method": "mtp", "num_speculative_tokens": 3},
         "ngram-K4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}}


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.8, seed=seed)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None)).eval()


def service(speculative: dict | None = None, **extra) -> ServiceConfig:
    return ServiceConfig.from_dict({
        "model": {"preset": "tiny", "max_model_len": 256},
        "memory": {"max_num_seqs": 4, "block_size": 64, "cache_bytes": 4_000_000, "prefix_cache": {}},
        "scheduler": {"max_batch_size": 8, "prefill_chunk_size": 128, "batch_invariant": True}}
        | ({"speculative": speculative} if speculative else {}) | extra)


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(SPECS))
def test_a_seeded_sample_does_not_depend_on_what_the_engine_served_before(model, spec):
    seeds = range(2)
    plain = [o.token_ids for o in Engine(model, service()).generate([PROMPT] * 2, [sampled(s) for s in seeds],
                                                                   use_tqdm=False)]
    for seed, expected in zip(seeds, plain):
        fresh = Engine(model, service(SPECS[spec])).generate([PROMPT], sampled(seed), use_tqdm=False)[0]
        warmed = Engine(model, service(SPECS[spec]))
        warmed.generate([OTHER], sampled(99), use_tqdm=False)
        after = warmed.generate([PROMPT], sampled(seed), use_tqdm=False)[0]
        assert warmed.scheduler.prefix_hit_tokens >= 128  # the hit that used to change the draws
        batched = Engine(model, service(SPECS[spec])).generate([OTHER, PROMPT], [sampled(99), sampled(seed)],
                                                               use_tqdm=False)[1]
        assert fresh.token_ids == after.token_ids == batched.token_ids, (seed, spec)
        if SPECS[spec]["method"] == "mtp":  # never drafted: plain decoding's draws exactly
            assert fresh.token_ids == expected
    greedy = Engine(model, service(SPECS[spec]))
    greedy.generate([PROMPT, OTHER], SamplingParams(max_tokens=8), use_tqdm=False)
    assert greedy.stats()["spec_draft_tokens"] > 0  # greedy requests are still drafted


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ngram-K4", "mtp-K3"])
def test_pd_with_speculation_hands_every_request_over_and_equals_colocated(model, spec):
    config = service(SPECS[spec], disaggregation={"prefill_instances": 1, "decode_instances": 1})
    prompts = [PROMPT, OTHER, PROMPT[:20], PROMPT[5:90]]
    params = [sampled(3), SamplingParams(max_tokens=8), sampled(5), SamplingParams(max_tokens=8)]
    colocated = Engine(model, service(SPECS[spec])).generate(prompts, params, use_tqdm=False)
    prefill, decode = Engine(model, role_config(config, "prefill")), Engine(model, role_config(config, "decode"))
    outputs, transfers = run_1p1d(prefill, decode, prompts, check_pools=False, params=params)
    assert len(transfers) == len(prompts)  # every request handed over (it used to be 1 of 4 with ngram)
    assert prefill.stats()["decode_tokens"] == 0 and prefill.speculator is None
    assert [o.token_ids for o in outputs] == [o.token_ids for o in colocated]
