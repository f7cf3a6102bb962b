import pytest

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import count_parameters, parameter_table


def test_tiny_counts_match_a_real_model():
    cfg = ModelConfig.from_preset("tiny")
    model = LatentMoEForCausalLM(cfg)
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    embeddings = model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    routed = sum(p.numel() for block in model.layers if block.is_moe for p in block.ffn.experts.parameters())
    assert counts["by_component"]["embeddings"]["total"] == embeddings
    assert counts["by_component"]["routed_experts"]["total"] == routed
    inactive_routed = routed * (1 - cfg.moe.top_k / cfg.moe.num_experts)
    assert counts["active"] == round(counts["total"] - embeddings - inactive_routed)
    assert counts["bytes"]["bf16"] == 2 * counts["total"]
    assert counts["bytes"]["experts_mxfp4"] < counts["bytes"]["experts_fp8"] < counts["bytes"]["bf16"]


def test_full_scale_counts_land_near_published():
    counts = count_parameters(ModelConfig.from_preset("k3-2.8t"))
    assert counts["total"] == pytest.approx(2.78e12, rel=0.01)
    assert counts["active"] == pytest.approx(104e9, rel=0.02)
    by = counts["by_component"]
    # 92 MoE layers x 896 experts x 3 matrices of latent 3584 x intermediate 3072
    assert by["routed_experts"]["total"] == 92 * 896 * 3 * 3584 * 3072
    assert by["embeddings"]["total"] == 2 * 163840 * 7168
    assert by["dense_ffn"]["total"] == 3 * 7168 * 33792
    assert by["embeddings"]["active"] == 0


def test_small_preset_is_in_its_band():
    assert 50e6 <= count_parameters(ModelConfig.from_preset("small"))["total"] <= 150e6


def test_parameter_table_mentions_published_figures():
    table = parameter_table(ModelConfig.from_preset("k3-2.8t"))
    assert "routed_experts" in table and "published" in table and "2.78T" in table
