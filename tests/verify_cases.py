"""What the verify tests share: a tiny model that repeats itself (so n-gram drafts get accepted, as they do on a
trained model, and the spec path really moves state) and service dicts that turn state-moving paths on."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import ServiceConfig
from latentmoe_lab.verify.drive import file_paths
from latentmoe_lab.verify.run import verify_engine

BASE = {"model": {"preset": "tiny", "max_model_len": 256},
        "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 4_000_000, "prefix_cache": {}},
        "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 32}}
NGRAM = {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}


def repeating_model() -> LatentMoEForCausalLM:
    """tiny with tied embeddings scaled up: the residual stream is mostly the current token's embedding, so
    greedy decoding falls into repeating a token after a few varied ones (drafts accepted and rejected both),
    while every layer still moves the logprobs (a corrupted state shows as a gap far above the tolerance)."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny")
    config.tie_word_embeddings = True
    model = LatentMoEForCausalLM(config).eval()
    with torch.no_grad():
        model.embed_tokens.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def model():
    return repeating_model()


def verify(model, service: dict, inject=None, prompts=4, max_tokens=6):
    config = ServiceConfig.from_dict(service)
    return verify_engine(model, config, file_paths(config), "test", prompts, max_tokens, 0, inject)
