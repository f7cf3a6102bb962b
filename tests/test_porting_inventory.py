"""The operator inventory (latentmoe_lab.porting.inventory): meta-device counts against a real run, the closed-form
FLOPs per token, the standard / custom split, the `ops` command and its errors."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from latentmoe_lab import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.porting.flops import expected_flops
from latentmoe_lab.porting.inventory import aggregate, op_kind, operator_inventory, trace_forward
from latentmoe_lab.porting.swap import use_custom_ops


# Reshapes copy or not depending on the strides a kernel returns; the CPU depthwise convolution of the small
# preset returns other strides than its meta kernel computes, so its KDA layers copy once more on CPU.
LAYOUT_OPS = {"aten.view", "aten._unsafe_view", "aten.clone"}


def _table(rows, skip=frozenset()):
    return {(r.layer_type, r.op): (r.count, r.flops, r.bytes_read, r.bytes_written) for r in rows if r.op not in skip}


@pytest.mark.parametrize("preset, phase, tokens, context", [("tiny", "prefill", 37, 0), ("tiny", "decode", 3, 20),
                                                            ("small", "prefill", 29, 0)])
def test_meta_inventory_equals_a_dispatch_trace_and_flop_counter_of_the_real_model(preset, phase, tokens, context):
    config = ModelConfig.from_preset(preset)
    inventory = operator_inventory(config, phase, tokens, context, dtype=torch.float32)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config).eval()
    real = trace_forward(model, phase, tokens, context)  # every layer, real CPU tensors
    skip = LAYOUT_OPS if preset == "small" else frozenset()
    assert _table(inventory.rows, skip) == _table(aggregate(real, model), skip)
    with FlopCounterMode(display=False) as counter:  # torch's own counter, custom-op formulas registered in it
        trace_forward(model, phase, tokens, context)
    assert counter.get_total_flops() == inventory.total_flops > 0
    assert {r.layer_type for r in inventory.rows} == {"embedding", "kda", "gated_dsa", "latent_moe", "dense_ffn",
                                                       "lm_head"}


def test_the_inventory_dispatches_what_the_model_computes():
    """Under use_custom_ops the traced forward is the model's: same logits as its own forward."""
    config = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 21))
    with torch.no_grad():
        expected = model(ids).logits
        with use_custom_ops():
            got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset, phase, tokens, context", [("k3-2.8t", "prefill", 2048, 0),
                                                            ("small", "decode", 4, 300)])
def test_flops_per_token_agree_with_two_times_active_parameters_plus_attention(preset, phase, tokens, context):
    config = ModelConfig.from_preset(preset)
    inventory = operator_inventory(config, phase, tokens, context)  # k3-2.8t: 2.8T parameters, all on meta
    expected = expected_flops(config, phase, tokens, context)
    assert abs(inventory.total_flops / expected["total"] - 1) < 0.02
    assert expected["weights"] > expected["kda"] > 0 and expected["dsa"] > 0


def test_standard_and_custom_work():
    assert op_kind("latentmoe.kda_chunk") == op_kind("aten.topk") == op_kind("aten.index_add_") == "custom"
    assert op_kind("aten.mm") == op_kind("aten.mul") == op_kind("aten.sum") == "standard"


def test_images_go_through_the_vision_tower():
    config = ModelConfig.from_preset("tiny")
    inventory = operator_inventory(config, "prefill", tokens=300, images=1)
    vision = [r for r in inventory.rows if r.layer_type == "vision"]
    blocks = config.vision.num_layers
    assert sum(r.flops for r in vision) > 0 and {r.layer_type for r in inventory.rows} >= {"vision", "kda"}
    assert next(r for r in vision if r.op == "aten.native_layer_norm").count == 2 * blocks + 2  # + merger, projector
    with pytest.raises(ValueError, match="images: only a prefill"):
        operator_inventory(config, "decode", tokens=1, images=1)
    with pytest.raises(ValueError, match="images: 2 images of 256 tokens each exceed the 300 prefill tokens"):
        operator_inventory(config, "prefill", tokens=300, images=2)


def test_bad_requests_are_one_line_errors():
    config = ModelConfig.from_preset("tiny")
    with pytest.raises(ValueError, match="phase: must be one of"):
        operator_inventory(config, "train")
    with pytest.raises(ValueError, match="tokens: must be an integer >= 1"):
        operator_inventory(config, "prefill", tokens=0)
