"""Speculative decoding over the cache tiers (docs/design.md §12, §15): with memory.offload (DSA latent rows in
a host tier, drafts verified through the hot buffers) and with the prefix-cache spill (prefixes evicted to the
host and read back while drafts are rolled back), greedy outputs stay those of model.generate.

Both run in the engine's process; the worker layouts (tp / pp / forward_process) are tests/test_spec_workers.py's.
"""
import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.planner import pools_bytes

BLOCK = 64
K = 3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None)).eval()


def greedy(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n)[0, len(prompt):].tolist()


def assert_drained(engine):
    stats = engine.stats()
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculation_with_offloaded_dsa_rows_keeps_greedy_exact(model, method):
    g = torch.Generator().manual_seed(5)
    pattern = torch.randint(0, 256, (24,), generator=g).tolist()
    # 150 > top-k 32 rows: decodes read their selection through the hot buffers; the repeats give ngram drafts
    prompts = [pattern * 6 + [7], torch.randint(0, 256, (20,), generator=g).tolist(), pattern * 2]
    params = SamplingParams(max_tokens=8)
    engine = Engine(model, ServiceConfig.from_dict({
        "model": {"max_model_len": 512},
        "memory": {"cache_bytes": 3_000_000, "block_size": 16, "max_num_seqs": 4,
                   "offload": {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 40}},
        "scheduler": {"prefill_chunk_size": 64}, "speculative": {"method": method, "num_speculative_tokens": K}}))
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.error is None and out.token_ids == greedy(model, prompt, params.max_tokens), len(prompt)
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["offload_rows_moved"] > 0
    assert_drained(engine)


def spill_service(model) -> ServiceConfig:
    """ngram K=3 (K + 1 slots per running sequence), 2 snapshot rows and 9 blocks of 64 tokens on the device,
    the rest of the prefix cache in a host tier."""
    data = {"model": {"max_model_len": 512},
            "memory": {"block_size": BLOCK, "max_num_seqs": 1,
                       "prefix_cache": {"snapshot_slots": 2, "host_bytes": 1 << 20}},
            "scheduler": {"prefill_chunk_size": 512, "max_batch_size": 4},
            "speculative": {"method": "ngram", "num_speculative_tokens": K}}
    probe = ServiceConfig.from_dict(data)
    block, slot = pools_bytes(model.config, probe, 1, 0), pools_bytes(model.config, probe, 0, 1)
    data["memory"]["cache_bytes"] = (K + 1 + 2) * slot + 9 * block
    return ServiceConfig.from_dict(data)


def test_speculation_with_the_prefix_cache_spill_keeps_greedy_exact(model):
    g = torch.Generator().manual_seed(3)
    # three 4-block prefixes in turn (the device holds one): every second visit reads a spilled prefix back;
    # each prefix repeats a 32-token pattern, so ngram drafts (and mostly has them rejected)
    prefixes = [torch.randint(0, 256, (32,), generator=g).tolist() * 8 for _ in range(3)]
    # suffixes past K tokens: a hit leaves the last tokens of a prompt to compute, more of them with drafts
    suffixes = ([1, 2, 3, 4], [4, 5, 6, 7, 8], [9] * 5, [7, 8, 9, 10], [11] * 4, [3, 2, 1, 0, 1])
    prompts = [prefixes[i % 3] + suffix for i, suffix in enumerate(suffixes)]
    params = SamplingParams(max_tokens=6)
    engine = Engine(model, spill_service(model))
    for prompt in prompts:  # one at a time: the device cache holds one prefix
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        assert out.error is None and out.token_ids == greedy(model, prompt, params.max_tokens), prompt[-2:]
    stats = engine.stats()
    assert stats["prefix_hits_host"] == 3 and stats["prefix_hits_refused"] == 0
    assert 0 <= stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert_drained(engine)
