"""quantize_model: the bytes a quantized model holds equal meta.recipe_bytes, exactly (docs/design.md §7)."""
import pytest
import torch
from accelerate import init_empty_weights

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import count_parameters, recipe_bytes
from latentmoe_lab.quant import RECIPES, QuantLatentExperts, QuantLinear, Recipe, held_bytes, quantize_model


def _batches(config, n=2):
    return [torch.randint(0, config.vocab_size, (2, 24)) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_tiny_bytes_equal_the_formula_for_every_recipe(name, tiny_config):
    model = LatentMoEForCausalLM(tiny_config).eval()
    recipe = RECIPES[name]
    needs_batches = recipe.activations == "static" or recipe.smooth_alpha is not None
    quantize_model(model, recipe, batches=_batches(tiny_config) if needs_batches else None, progress=False)
    assert held_bytes(model) == recipe_bytes(tiny_config, name, "fp32")["total"]
    ids = torch.randint(0, tiny_config.vocab_size, (1, 20))
    assert torch.isfinite(model(ids).logits).all()
    model.to(torch.bfloat16)
    assert held_bytes(model) == recipe_bytes(tiny_config, name, "bf16")["total"]
    assert torch.isfinite(model(ids).logits).all()


def test_what_stays_high_precision(tiny_config):
    model = quantize_model(LatentMoEForCausalLM(tiny_config), "fp8-all-linear", progress=False)
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and isinstance(model.lm_head, torch.nn.Linear)
    for block in model.layers:
        attn = block.attn
        if block.attention_type == "kda":
            assert isinstance(attn.q_proj, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
            for gate in (attn.f_down, attn.f_up, attn.b_proj, attn.g_proj):
                assert isinstance(gate, torch.nn.Linear)
        else:
            assert isinstance(attn.wkv_b, QuantLinear) and isinstance(attn.w_gate, torch.nn.Linear)
            assert isinstance(attn.indexer.w_heads, torch.nn.Linear)
        if block.is_moe:
            assert isinstance(block.ffn.router, torch.nn.Linear) and isinstance(block.ffn.experts, QuantLatentExperts)
    assert all(isinstance(m, torch.nn.Linear) for m in model.vision.modules() if hasattr(m, "in_features"))


def test_quantized_moe_forward_equals_its_token_by_token_reference(tiny_config):
    model = quantize_model(LatentMoEForCausalLM(tiny_config).eval(), "mxfp4-experts", progress=False)
    moe = model.layers[1].ffn
    x = torch.randn(2, 9, tiny_config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), moe.reference_forward(x), rtol=1e-5, atol=1e-6)


def test_small_bytes_equal_the_formula():
    config = ModelConfig.from_preset("small")
    with init_empty_weights(include_buffers=True):  # skip the random init of 122M parameters
        model = LatentMoEForCausalLM(config)
    model.to_empty(device="cpu")
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensor.data.fill_(0.5)  # the values do not change the bytes; tiny covers mxfp4 (slow to pack here)
    model = quantize_model(model, "fp8-all-linear", progress=False)
    assert held_bytes(model) == recipe_bytes(config, "fp8-all-linear", "fp32")["total"]


def test_full_scale_recipe_bytes_agree_with_the_bits_per_weight_table():
    config = ModelConfig.from_preset("k3-2.8t")
    table = count_parameters(config)["bytes"]
    for recipe, key in (("fp8-experts", "experts_fp8"), ("mxfp4-experts", "experts_mxfp4")):
        exact = recipe_bytes(config, recipe, "bf16")
        # Every k3-2.8t expert dim is a multiple of 128, so the exact layout meets the average bits per weight.
        assert exact["total"] - exact["buffers"] == table[key]
    assert exact["buffers"] == 92 * 896 * 4  # the fp32 routing biases


def test_bad_recipes_are_refused(tiny_config):
    with pytest.raises(ValueError, match="recipe: must be"):
        quantize_model(LatentMoEForCausalLM(tiny_config), "fp3-everything")
    with pytest.raises(ValueError, match="weights.mla: mxfp4 is for"):
        Recipe("x", {"mla": "mxfp4"})
    with pytest.raises(ValueError, match="weights.router: not a quantizable"):
        Recipe("x", {"router": "fp8"})
    with pytest.raises(ValueError, match="smooth_alpha"):
        Recipe("x", {"mla": "int8"}, smooth_alpha=0.5)
    model = quantize_model(LatentMoEForCausalLM(tiny_config), "fp8-experts", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "fp8-experts")
    with pytest.raises(ValueError, match="batches: SmoothQuant"):
        quantize_model(LatentMoEForCausalLM(tiny_config), "int8-w8a8-smooth")
