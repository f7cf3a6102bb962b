import json

import pytest

from latentmoe_lab.config import PRESETS, ModelConfig, default_layer_types


def test_full_scale_pattern_matches_design():
    cfg = ModelConfig.from_preset("k3-2.8t")
    dsa_layers = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "dsa"]
    assert dsa_layers == list(range(4, 93, 4)) + [93]
    assert (cfg.num_dsa_layers, cfg.num_kda_layers) == (24, 69)
    assert cfg.moe.num_experts == 896 and cfg.moe.top_k == 16 and cfg.moe.latent_size == 3584
    assert cfg.hidden_size // cfg.moe.latent_size == 2
    assert cfg.indexer.topk == 2048 and cfg.max_position_embeddings == 1_048_576
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)


def test_tiny_preset_activates_every_mechanism():
    cfg = ModelConfig.from_preset("tiny")
    assert cfg.indexer.topk < 256
    assert cfg.moe.latent_size < cfg.hidden_size
    assert cfg.moe.num_shared_experts >= 1 and cfg.moe.num_experts > cfg.moe.top_k
    assert cfg.first_dense_layers >= 1
    assert cfg.layer_types[:4] == ["kda", "kda", "kda", "dsa"]
    assert 1 < cfg.moe.n_group and cfg.moe.topk_group < cfg.moe.n_group


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_json_and_yaml_round_trip(preset, tmp_path):
    cfg = ModelConfig.from_preset(preset)
    assert ModelConfig.from_json_text(cfg.to_json()) == cfg
    assert ModelConfig.from_yaml_text(cfg.to_yaml()) == cfg
    cfg.to_yaml(tmp_path / "c.yaml")
    cfg.to_json(tmp_path / "c.json")
    assert ModelConfig.from_yaml(tmp_path / "c.yaml") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["moe"]["top_k"] == cfg.moe.top_k


def test_default_layer_types_final_layer_rule():
    assert default_layer_types(5, 4, True) == ["kda", "kda", "kda", "dsa", "dsa"]
    assert default_layer_types(5, 4, False) == ["kda", "kda", "kda", "dsa", "kda"]


def test_replace_rederives_pattern():
    cfg = ModelConfig.from_preset("tiny").replace(num_layers=8)
    assert cfg.layer_types == ["kda", "kda", "kda", "dsa"] * 2


@pytest.mark.parametrize("changes, field", [
    (dict(moe=dict(num_experts=4, top_k=8, n_group=1, topk_group=1)), "moe.top_k"),
    (dict(moe=dict(latent_size=128)), "moe.latent_size"),
    (dict(indexer=dict(topk=0)), "indexer.topk"),
    (dict(layer_types=["kda", "dsa"]), "layer_types"),
    (dict(layer_types=["kda", "kda", "mamba", "dsa"]), "layer_types"),
    (dict(moe=dict(num_experts=8, n_group=3)), "moe.n_group"),
    (dict(moe=dict(n_group=2, topk_group=3)), "moe.topk_group"),
    (dict(moe=dict(num_experts=8, top_k=6, n_group=4, topk_group=2)), "moe.top_k"),
    (dict(moe=dict(num_experts=8, top_k=1, n_group=8, topk_group=2)), "moe.n_group"),
    (dict(vision=dict(hidden_size=30, num_heads=4)), "vision.num_heads"),
    (dict(kda=dict(num_heads=0)), "kda.num_heads"),
    (dict(kda=dict(gate_form="relu")), "kda.gate_form"),
    (dict(kda=dict(gate_lower_bound=1.0)), "kda.gate_lower_bound"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(first_dense_layers=9), "first_dense_layers"),
    (dict(mla=dict(kv_lora_rank=1000)), "mla.kv_lora_rank"),
    (dict(indexer=dict(topk=10**7)), "indexer.topk"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(moe=dict(activation_clamp=-1.0)), "moe.activation_clamp"),
    (dict(moe=dict(routed_scaling_factor=0.0)), "moe.routed_scaling_factor"),
])
def test_invalid_configs_name_the_field(changes, field):
    data = ModelConfig.from_preset("tiny").to_dict()
    for key, value in changes.items():
        if isinstance(value, dict):
            data[key].update(value)
        else:
            data[key] = value
    with pytest.raises(ValueError, match=rf"^{field}:"):
        ModelConfig.from_dict(data)


def test_unknown_field_and_preset_are_refused():
    with pytest.raises(ValueError, match="moe.experts"):
        ModelConfig.from_dict({"moe": {"experts": 3}})
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.from_preset("huge")
    with pytest.raises(TypeError, match="config data"):
        ModelConfig.from_dict([1, 2])
