"""Taps: stable names, outputs unchanged, the token subset, repeated forwards, clean removal."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.alignment.taps import ExpertChoice, TokenSubset, record_taps, tap_points


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


@pytest.fixture
def ids(tiny_config):
    return torch.randint(0, tiny_config.vocab_size, (2, 37))  # 37: not a multiple of any chunk or stride


def test_names_follow_the_config_in_forward_order(tiny_config):
    names = [p.name for p in tap_points(tiny_config)]
    assert names[:4] == ["embed", "layers.0.attn", "layers.0.ffn", "layers.0.residual"]  # layer 0 is dense
    assert names[4:9] == ["layers.1.attn", "layers.1.moe.router_logits", "layers.1.moe.experts",
                          "layers.1.ffn", "layers.1.residual"]
    assert names[-2:] == ["norm", "logits"]
    moe_layers = [i for i in range(tiny_config.num_layers) if tiny_config.is_moe_layer(i)]
    assert len(names) == 3 + 3 * tiny_config.num_layers + 2 * len(moe_layers)


def test_taps_do_not_change_outputs_and_record_every_point(model, ids, tiny_config):
    with torch.no_grad():
        plain = model(ids).logits
        with record_taps(model) as rec:
            tapped = model(ids).logits
        after = model(ids).logits
    assert torch.equal(plain, tapped) and torch.equal(plain, after)
    assert rec.names() == [p.name for p in tap_points(tiny_config)]
    assert torch.equal(rec["logits"], plain)
    hidden = tiny_config.hidden_size
    assert rec["embed"].shape == (2, 37, hidden)
    assert torch.equal(rec["embed"], model.embed_tokens(ids))
    assert rec["layers.1.moe.router_logits"].shape == (2, 37, tiny_config.moe.num_experts)
    choice = rec["layers.1.moe.experts"]
    assert isinstance(choice, ExpertChoice) and choice.shape == (2, 37, tiny_config.moe.top_k)
    # the residual after block i is block i's input plus its attention and FFN outputs
    assert torch.allclose(rec["layers.2.residual"],
                          rec["layers.1.residual"] + rec["layers.2.attn"] + rec["layers.2.ffn"], atol=1e-6)
    # the recorded routing is the routing itself
    moe = model.layers[1].ffn
    x = model.layers[1].ffn_norm(rec["layers.1.residual"] - rec["layers.1.ffn"]).flatten(0, 1)
    with torch.no_grad():
        weights, indices = moe.route(x)
    assert torch.equal(choice.indices.flatten(0, 1), indices)
    assert "select_experts" not in vars(moe)  # the wrapper is gone


def test_token_subset_bounds_memory_and_keeps_positions(model, ids):
    subset = TokenSubset(stride=4, max_tokens=5)
    with torch.no_grad(), record_taps(model, subset) as rec:
        full = model(ids).logits
    assert rec.positions["logits"].tolist() == [0, 4, 8, 12, 16]
    assert rec["logits"].shape == (2, 5, full.shape[-1])
    assert torch.equal(rec["logits"], full[:, [0, 4, 8, 12, 16]])
    assert rec["layers.3.moe.experts"].shape[:2] == (2, 5)


def test_repeated_forwards_append_and_count_positions_across_calls(model, ids):
    """Prefill then decode steps through a cache: the taps continue along the token axis."""
    subset = TokenSubset(stride=3)
    with torch.no_grad():
        whole = model(ids[:, :12]).logits
        cache = model.new_cache()
        with record_taps(model, subset) as rec:
            model(ids[:, :7], cache=cache)
            for t in range(7, 12):
                model(ids[:, t:t + 1], cache=cache)
    assert rec.positions["logits"].tolist() == [0, 3, 6, 9]
    assert torch.allclose(rec["logits"], whole[:, [0, 3, 6, 9]], atol=1e-5)
    assert rec["layers.2.moe.experts"].shape[:2] == (2, 4)


def test_only_a_few_names_and_nested_blocks(model, ids):
    with torch.no_grad(), record_taps(model, only={"logits"}) as outer:
        with record_taps(model, only={"layers.1.moe.experts"}) as inner:
            model(ids)
        model(ids)  # only the outer block still records
    assert outer.names() == ["logits"] and outer["logits"].shape[1] == 2 * 37
    assert inner.names() == ["layers.1.moe.experts"] and inner["layers.1.moe.experts"].shape[1] == 37
    assert "select_experts" not in vars(model.layers[1].ffn)


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="stride"):
        TokenSubset(stride=0)
    with pytest.raises(ValueError, match="max_tokens"):
        TokenSubset(max_tokens=0)
    with pytest.raises(ValueError, match="only: unknown tap names"):
        with record_taps(model, only={"layers.9.attn"}):
            pass
    with pytest.raises(TypeError, match="model: expected"):
        with record_taps(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(KeyError, match="was not recorded"):
        with record_taps(model, only={"logits"}) as rec:
            pass
        rec["embed"]
