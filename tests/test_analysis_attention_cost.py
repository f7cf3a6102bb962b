"""Token-mixer costs from the config: constant KDA state, linear DSA cache, top-k saturation, the 3:1 split."""
import math

import pytest

from latentmoe_lab.analysis.attention_cost import (dsa_cost, gqa_cache_bytes, hybrid_cost, kda_cost, layer_counts,
                                                   ratio_table)
from latentmoe_lab.config import ModelConfig

FULL = ModelConfig.from_preset("k3-2.8t")


def test_kda_state_is_constant_and_matches_the_design():
    state = 96 * 128 * 128 * 4 + 2 * (3 * 96 * 128) * 3  # fp32 state + bf16 conv tail of q|k|v
    for context in (1, 4096, 2 ** 20):
        assert kda_cost(FULL, context) == kda_cost(FULL, 1)
    assert kda_cost(FULL, 1).state_bytes == state


def test_dsa_cache_grows_per_token_by_latent_rope_and_index_key():
    per_token = (512 + 64) * 2 + 128 * 1 + 4  # bf16 latent + rope, FP8 index key, fp32 scale
    assert dsa_cost(FULL, 2000).state_bytes - dsa_cost(FULL, 1000).state_bytes == 1000 * per_token
    assert dsa_cost(FULL, 1000, sparse=False).state_bytes == 1000 * (512 + 64) * 2


def test_sparse_attention_stops_growing_at_top_k_while_the_indexer_does_not():
    index_per_key = 2 * 64 * 128
    attention_per_key = 2 * 96 * (2 * 512 + 64)
    assert dsa_cost(FULL, 2048).flops - dsa_cost(FULL, 2047).flops == index_per_key + attention_per_key
    assert dsa_cost(FULL, 4097).flops - dsa_cost(FULL, 4096).flops == index_per_key
    assert dsa_cost(FULL, 4097, sparse=False).flops - dsa_cost(FULL, 4096, sparse=False).flops == attention_per_key


def test_layer_counts_follow_the_dsa_interval():
    assert layer_counts(FULL, 3) == (69, 24)  # the published 3:1 model
    assert layer_counts(FULL, 0) == (0, 93)
    assert layer_counts(FULL, math.inf) == (93, 0)
    with pytest.raises(ValueError, match="kda_per_dsa: expected an integer >= 0"):
        layer_counts(FULL, -1)


def test_hybrid_totals_and_table():
    row = hybrid_cost(FULL, 2 ** 20, 3)
    assert row["flops"] == 69 * kda_cost(FULL, 1).flops + 24 * dsa_cost(FULL, 2 ** 20).flops
    assert row["dense_state_bytes"] == 93 * dsa_cost(FULL, 2 ** 20, sparse=False).state_bytes
    assert row["flops"] < 0.03 * row["dense_flops"]
    table = ratio_table(FULL, [4096, 8192], [1, 3])
    assert [(r["context"], r["kda_per_dsa"]) for r in table] == [(4096, 1), (4096, 3), (8192, 1), (8192, 3)]


def test_gqa_reference_number_from_the_design():
    assert gqa_cache_bytes(80, 8, 128, 1_000_000, 1) == pytest.approx(163.84e9)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="context: expected a positive integer"):
        kda_cost(FULL, 0)
    with pytest.raises(TypeError, match="config: expected a ModelConfig"):
        dsa_cost({}, 10)
