"""Quantized and serving-engine candidates against the reference."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.alignment import EngineCandidate, TokenSubset, bisect_layers, compare, quantized_candidate, record
from latentmoe_lab.serving import ServiceConfig


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


@pytest.fixture
def ids():
    return torch.randint(0, 256, (2, 37))  # byte tokens; 37 = two chunks of 16 and a ragged 5


def _service(kv_cache_dtype: str = "auto") -> ServiceConfig:
    return ServiceConfig.from_dict({"model": {"max_model_len": 64},
                                    "memory": {"kv_cache_dtype": kv_cache_dtype, "cache_bytes": 4 << 20,
                                               "max_num_seqs": 1, "block_size": 16},
                                    "scheduler": {"prefill_chunk_size": 16}})


def test_a_quantization_recipe_is_a_candidate_and_bisects(model, ids):
    candidate = quantized_candidate(model, "int8-experts")
    assert candidate.name == "int8-experts" and getattr(model, "quant_recipe", None) is None  # a copy
    report = compare(model, candidate, ids)
    assert report.candidate_name == "int8-experts"
    dense = [r for r in report.rows if r.layer == 0 or r.name == "embed"]
    assert all(r.max_abs == 0.0 for r in dense)  # the recipe packs routed experts only; layer 0 is dense
    assert report.row("layers.1.ffn").max_abs > 0 and report.row("logits").kl_mean > 0
    result = bisect_layers(model, candidate, ids)
    assert result.alone["layers.0"] == 0.0 and result.alone["embed_tokens"] == 0.0
    assert result.culprit in {"layers.1", "layers.2", "layers.3"}


def test_the_engine_aligns_with_forward_and_logits_sit_at_chunk_ends(model, ids):
    report = compare(model, EngineCandidate(model, _service()), ids)
    assert report.first_divergence is None
    assert all(r.rel_l2 < 1e-5 for r in report.rows if r.rel_l2 is not None)
    assert all(r.routing_flips == 0.0 for r in report.rows if r.kind == "experts")
    assert report.row("logits").shape == (2, 3, model.config.vocab_size)  # chunk ends 15, 31, 36
    recording = record(EngineCandidate(model, _service()), ids[:1])
    assert recording.positions["logits"].tolist() == [15, 31, 36]
    assert recording["layers.3.residual"].shape[:2] == (1, 37)


def test_fp8_kv_moves_the_dsa_layer_first_and_the_engine_refuses_what_it_cannot_gather(model, ids):
    report = compare(model, EngineCandidate(model, _service("fp8"), "fp8-kv"), ids, thresholds={"rel_l2": 1e-4})
    first = report.first_divergence
    dsa = model.config.layer_types.index("dsa")  # the MLA latent cache is what fp8 stores
    assert first is not None and first.name == f"layers.{dsa}.attn"
    assert all(r.rel_l2 < 1e-5 for r in report.rows[:report.rows.index(first)] if r.rel_l2 is not None)
    assert report.row("logits").kl_mean < 1e-3
    with pytest.raises(ValueError, match="records every token"):
        record(EngineCandidate(model, _service()), ids, TokenSubset(stride=2))
