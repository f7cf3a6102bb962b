"""Quantized checkpoints (docs/design.md §7, §9): packed tensors + scales + the recipe, bit-identical round trip."""
import json

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.quant import quantize_model
from latentmoe_lab.quant.checkpoint import load_quantized, save_quantized


def _assert_bit_identical(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("recipe,dtype,shard", [("mxfp4-experts", torch.float32, "2GB"),
                                                ("int8-w8a8-smooth", torch.float32, "100KB"),
                                                ("fp8-all-linear", torch.bfloat16, "2GB")])
def test_round_trip_is_bit_identical(recipe, dtype, shard, tiny_config, tmp_path):
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24))
    model = LatentMoEForCausalLM(tiny_config).eval()
    quantize_model(model, recipe, batches=[ids], progress=False)
    model.to(dtype)
    path = save_quantized(model, tmp_path / "q", max_shard_size=shard)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["name"] == recipe
    assert shard == "2GB" or (path / "model.safetensors.index.json").exists()
    loaded = load_quantized(path)
    _assert_bit_identical(model, loaded)
    assert loaded.quant_recipe == model.quant_recipe
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_plain_and_quantized_checkpoints_are_not_mixed_up(tiny_config, tmp_path):
    model = LatentMoEForCausalLM(tiny_config)
    with pytest.raises(ValueError, match="model: not quantized"):
        save_quantized(model, tmp_path / "x")
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="plain checkpoint"):
        load_quantized(tmp_path / "plain")
    quantized = save_quantized(quantize_model(model, "fp8-experts", progress=False), tmp_path / "q")
    through_plain_loader = LatentMoEForCausalLM.from_pretrained(quantized)  # goes to load_quantized
    assert through_plain_loader.quant_recipe == model.quant_recipe
    _assert_bit_identical(load_quantized(quantized), through_plain_loader)
    with pytest.raises(ValueError, match="dtype: .* quantized checkpoint.*load_quantized"):
        LatentMoEForCausalLM.from_pretrained(quantized, dtype=torch.bfloat16)
