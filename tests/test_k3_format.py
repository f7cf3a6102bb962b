"""The K3 checkpoint format (docs/design.md §18): config.json both ways, and a small synthetic checkpoint written
from the published names and shapes (tests/k3_synthetic.py) read, run and written back bit for bit."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from k3_synthetic import public_config, shrunk_config, with_text, write_synthetic
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.interop import k3
from latentmoe_lab.interop.k3_checkpoint import load_k3, save_k3
from latentmoe_lab.interop.names import Unexpressible
from latentmoe_lab.model import LatentMoEForCausalLM

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The compressed-tensors MXFP4 rule written out here: low nibble first, group of 32 times 2^(e - 127)."""
    table = torch.tensor(E2M1)
    values = torch.stack([table[(packed & 15).long()], table[(packed >> 4).long()]], dim=-1).flatten(-2)
    return values * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)


def _all_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    directory = tmp_path_factory.mktemp("k3") / "source"
    return directory, write_synthetic(directory, shrunk_config())


def test_published_config_reads_as_k3_public():
    config = k3.config_from_hf(public_config())
    preset = ModelConfig.from_preset("k3-public")
    assert config.replace(name=preset.name) == preset
    assert config.layer_types[3] == "dsa" and config.layer_types[92] == "dsa" and config.num_kda_layers == 69
    assert k3.config_from_hf(k3.config_to_hf(config)) == config


def test_dense_activation_is_checked():
    with pytest.raises(ValueError, match="dense_activation: must be one of"):
        ModelConfig.from_preset("tiny").replace(dense_activation="gelu")


@pytest.mark.parametrize("changes, key", [
    (dict(linear_attn_config=dict(kda_layers=[0, 1, 2], full_attn_layers=[3, 4])), "kda_layers"),
    (dict(linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[3, 4, 5])), "full_attn_layers"),
    (dict(linear_attn_config=dict(kda_layers=[1, 2], full_attn_layers=[4, 5])), "kda_layers"),
    (dict(hidden_act="gelu"), "hidden_act"), (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(moe_layer_freq=2), "moe_layer_freq"), (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (dict(latent_moe_use_norm=False), "latent_moe_use_norm"),
])
def test_config_refused_naming_the_key(changes, key):
    hf = shrunk_config()
    linear = changes.pop("linear_attn_config", None)
    if linear:
        hf["text_config"]["linear_attn_config"].update(linear)
    with pytest.raises(ValueError, match=key):
        k3.config_from_hf(with_text(hf, **changes))


@pytest.mark.parametrize("changes, feature", [
    (dict(dsa=dict(use_indexer=True)), "indexer"), (dict(mtp_depth=1), "MTP"),
    (dict(kda=dict(gate_form="softplus")), "gate_form"), (dict(kda=dict(output_gate_rank=8)), "output_gate_rank"),
    (dict(dense_activation="swiglu"), "dense_activation"),
])
def test_export_refuses_what_k3_cannot_say(changes, feature):
    config = k3.config_from_hf(shrunk_config())
    data = config.to_dict()
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    with pytest.raises(Unexpressible, match=feature):
        k3.config_to_hf(ModelConfig.from_dict(data))
    with pytest.raises(Unexpressible, match="vision"):
        k3.config_to_hf(ModelConfig.from_preset("tiny"))


@pytest.mark.parametrize("experts", ["packed", "dequantize"])
def test_round_trip_is_bit_exact(synthetic, tmp_path, experts):
    source, written = synthetic
    model = load_k3(LatentMoEForCausalLM, source, experts=experts)
    assert type(model.layers[1].ffn.experts).__name__ == ("QuantLatentExperts" if experts == "packed" else
                                                          "LatentExperts")
    if experts == "dequantize":  # decoded exactly: gate rows of w13 are w1, by the rule written out above
        block = "language_model.model.layers.2.block_sparse_moe.experts.3.w1."
        expected = _decode(written[block + "weight_packed"], written[block + "weight_scale"])
        assert torch.equal(model.layers[2].ffn.experts.w13[3, :, :32].t(), expected)
        return
    out = save_k3(model, tmp_path / "again")
    again = _all_tensors(out)
    assert set(again) == set(written)
    for name, tensor in written.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    hf = json.loads((out / "config.json").read_text())
    assert hf["text_config"]["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert hf["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == len(written)


def test_a_log_is_narrowed_and_padding_must_be_zero(synthetic, tmp_path):
    source, written = synthetic
    model = load_k3(LatentMoEForCausalLM, source, experts="packed")
    assert model.quant_recipe.name == "mxfp4-experts"
    stored = written["language_model.model.layers.1.self_attn.A_log"]
    assert stored.shape == (4,) and torch.equal(model.layers[1].attn.A_log, stored[:3])
    bad = tmp_path / "bad"
    write_synthetic(bad, shrunk_config(), a_log_padding=0.5)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.A_log.*zero padding"):
        load_k3(LatentMoEForCausalLM, bad)


def test_packed_and_dequantized_experts_give_the_same_logits(synthetic):
    source, _ = synthetic
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    packed = load_k3(LatentMoEForCausalLM, source, experts="packed")
    plain = load_k3(LatentMoEForCausalLM, source, experts="dequantize")
    assert packed.layers[1].ffn.experts.situ_betas == (4.0, 25.0) == packed.layers[0].ffn.situ_betas  # dense too
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_our_model_round_trips_through_the_format(tmp_path):
    config = k3.config_from_hf(shrunk_config())
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    for block in model.layers:  # non-zero AttnRes queries so the names that carry them are checked
        if block.attn_res is not None:
            torch.nn.init.normal_(block.attn_res.attn.query)
    out = save_k3(model, tmp_path / "ours", experts="plain", dtype=torch.float32)
    back = load_k3(LatentMoEForCausalLM, out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_from_pretrained_and_export_reach_the_k3_format(synthetic, tmp_path):
    from latentmoe_lab.interop.export import export_transformers

    source, written = synthetic
    model = LatentMoEForCausalLM.from_pretrained(source)
    assert type(model.layers[1].ffn.experts).__name__ == "LatentExperts"  # a plain model, as from_pretrained gives
    assert torch.equal(model.embed_tokens.weight, written["language_model.model.embed_tokens.weight"].float())
    out = export_transformers(model, tmp_path / "exported", "kimi_k3")  # decoded experts re-pack to the same values
    assert set(_all_tensors(out)) == set(written)  # the release's names: MXFP4 weight_packed / weight_scale pairs
    again = LatentMoEForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_plain_experts_are_packed_by_our_mxfp4_rounding(tmp_path):
    from latentmoe_lab.quant.weight_mxfp4 import MXFP4Format

    config = k3.config_from_hf(shrunk_config(attn_res=False))
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    back = load_k3(LatentMoEForCausalLM, save_k3(model, tmp_path / "mx", dtype=torch.float32))
    fmt = MXFP4Format()
    for layer in (1, 4):
        for name in ("w13", "w2"):
            ours = getattr(model.layers[layer].ffn.experts, name).detach()  # [E, in, out], packed as [E, out, in]
            expected = fmt.unpack(fmt.pack(ours.transpose(1, 2))).transpose(1, 2)
            assert torch.equal(getattr(back.layers[layer].ffn.experts, name), expected), (layer, name)


def test_checkpoint_problems_are_named(tmp_path):
    hf = shrunk_config()
    vision = {"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3, 2, 2, dtype=torch.bfloat16)}
    write_synthetic(tmp_path / "vision", hf, extra=vision)
    load_k3(LatentMoEForCausalLM, tmp_path / "vision")  # MoonViT tensors are skipped, not refused
    write_synthetic(tmp_path / "extra", hf, extra={"language_model.model.stray.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected tensor 'language_model.model.stray.weight'"):
        load_k3(LatentMoEForCausalLM, tmp_path / "extra")
    wrong = with_text(hf, moe_intermediate_size=64)
    write_synthetic(tmp_path / "shape", hf)
    (tmp_path / "shape" / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(ValueError, match="shape"):
        load_k3(LatentMoEForCausalLM, tmp_path / "shape")
    with pytest.raises(ValueError, match="experts"):
        load_k3(LatentMoEForCausalLM, tmp_path / "vision", experts="fp8")


def test_an_mxfp4_quantized_model_saves_its_bytes_and_fp8_is_refused(tmp_path):
    from latentmoe_lab.quant.quantize import quantize_model

    config = k3.config_from_hf(shrunk_config(attn_res=False))
    torch.manual_seed(0)
    model = quantize_model(LatentMoEForCausalLM(config), "mxfp4-experts", progress=False)
    back = load_k3(LatentMoEForCausalLM, save_k3(model, tmp_path / "q", dtype=torch.float32), experts="packed")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name].to(tensor.dtype), tensor), name
    for recipe, feature in (("fp8-experts", "fp8 experts"), ("mxfp4-experts-fp8-rest", "QuantLinear")):
        other = quantize_model(LatentMoEForCausalLM(config), recipe, progress=False)
        with pytest.raises(Unexpressible, match=feature):
            save_k3(other, tmp_path / recipe)
