"""The k3-public preset (docs/design.md §18): its counts against the K3 report, the full-size K3 tensor list it
implies (built on the meta device) against the published names / shapes / dtypes (tests/data), and its
differences from k3-2.8t, which the README table lists."""
from __future__ import annotations

import pytest
import torch

from k3_synthetic import DTYPES, public_tensors
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.interop import k3
from latentmoe_lab.interop.k3_checkpoint import stored_specs
from latentmoe_lab.meta import PUBLISHED, build_meta_model, count_parameters

# Every field where k3-public differs from k3-2.8t (the README / design §18 table lists each with its source).
DIFFERENCES = {
    "name": ("k3-2.8t", "k3-public"),
    "rms_norm_eps": (1e-6, 1e-5),
    "dense_activation": ("swiglu", "situ"),
    "attn_res_block_size": (None, 12),
    "vision": ("VisionConfig", None),
    "mla.latent_norm_eps": (None, 1e-6),
    "dsa.use_indexer": (True, False),
    "moe.activation": ("swiglu", "situ"),
    "moe.bias_update": ("sign", "quantile"),
}


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "vision":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = "VisionConfig" if key == "vision" and value is not None else value
    return out


def test_differences_from_the_seeds_preset_are_the_listed_ones():
    seeds = _flat(ModelConfig.from_preset("k3-2.8t").to_dict())
    public = _flat(ModelConfig.from_preset("k3-public").to_dict())
    differ = {key: (seeds[key], public[key]) for key in seeds if seeds[key] != public[key]}
    assert differ == DIFFERENCES


def test_counts_match_the_report_on_meta(monkeypatch, capsys):
    """Report Table 1: 2.78T total, 104.2B activated. Ours counts the text model (MoonViT not modelled) and leaves
    the LM head out of "active"; with the LM head the activated count lands on the report's figure. The `info`
    command prints the comparison (from the same count: one meta build)."""
    from latentmoe_lab import meta
    from latentmoe_lab.cli import main

    config = ModelConfig.from_preset("k3-public")
    counts = count_parameters(config)
    published = PUBLISHED["k3-public"]
    assert abs(counts["total"] / published["total"] - 1) < 0.002
    assert abs(counts["active"] / published["active"] - 1) < 0.015
    head = config.vocab_size * config.hidden_size
    assert abs((counts["active"] + head) / published["active"] - 1) < 0.001
    assert counts["by_component"]["indexer"]["total"] == 0 and counts["by_component"]["attn_res"]["total"] > 0
    monkeypatch.setattr(meta, "count_parameters", lambda c: counts if c == config else pytest.fail("rebuilt"))
    assert main(["info", "--preset", "k3-public"]) == 0
    ratios = f"ours: {counts['total'] / published['total']:.4f}x total, {counts['active'] / published['active']:.4f}x"
    assert f"published: ~2.78T total, ~104.20B active; {ratios} active" in capsys.readouterr().out


@pytest.fixture(scope="module")
def full_size_specs():
    config = ModelConfig.from_preset("k3-public")
    model = build_meta_model(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    return stored_specs(k3.name_table(config), shapes, quantized=True)


def test_full_size_tensor_list_matches_the_published_one(full_size_specs):
    public = public_tensors()
    ours = {name: (shape, dtype) for name, shape, dtype, _ in full_size_specs}
    assert len(ours) == len(full_size_specs)  # no name twice
    for section in ("top", "layer_0_kda_dense", "layer_11_mla_moe_without_routed_experts", "layer_1_expert_0"):
        for name, (shape, dtype) in public[section].items():
            assert ours.get(name) == (tuple(shape), DTYPES[dtype]), name
    layer_11 = {n for n in ours if n.startswith("language_model.model.layers.11.") and ".experts." not in n}
    assert layer_11 == set(public["layer_11_mla_moe_without_routed_experts"])
    assert len(ours) + public["vision_tensor_count"] == public["index_tensor_count"]


def test_full_size_bytes_match_the_published_index(full_size_specs):
    """Our stored bytes plus MoonViT's two shards (whose file sizes include their headers) = the index total."""
    public = public_tensors()
    ours = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype, _ in full_size_specs)
    vision_files = sum(public["vision_shard_file_bytes"].values())
    vision_tensors = public["index_total_size_bytes"] - ours
    assert 0 < vision_files - vision_tensors < 64 * 1024
