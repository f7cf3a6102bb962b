"""Issue 12 item 1: a forward that does not finish invalidates its cache; a cache must match the model."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


def _interrupt(module, args):
    raise KeyboardInterrupt


@torch.no_grad()
def test_interrupted_forward_makes_the_cache_refuse_reuse(model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 12))
    cache = model.new_cache()
    model(ids[:, :8], cache=cache)
    handle = model.layers[3].register_forward_pre_hook(_interrupt)  # layers 0-2 have appended, layer 3 not
    with pytest.raises(KeyboardInterrupt):
        model(ids[:, 8:10], cache=cache)
    handle.remove()
    assert cache.seq_len == 8
    with pytest.raises(ValueError, match=r"cache: unusable.*KeyboardInterrupt in layer 3"):
        model(ids[:, 8:10], cache=cache)
    # a cache that did finish keeps working, and matches the uncached forward
    fresh = model.new_cache()
    model(ids[:, :8], cache=fresh)
    torch.testing.assert_close(model(ids[:, 8:10], cache=fresh).logits, model(ids[:, :10]).logits[:, 8:],
                               atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_an_error_inside_a_layer_invalidates_too(model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 6))
    cache = model.new_cache()
    model(ids, cache=cache)

    def fail(module, args):
        raise RuntimeError("out of memory (simulated)")

    handle = model.layers[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="simulated"):
        model(ids[:, :1], cache=cache)
    handle.remove()
    with pytest.raises(ValueError, match="RuntimeError in layer 2"):
        model(ids[:, :1], cache=cache)


@torch.no_grad()
def test_cache_must_match_the_model(model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (2, 5))
    cache = model.new_cache()
    model(ids, cache=cache)
    assert cache.batch_size == 2
    with pytest.raises(ValueError, match="cache: holds 2 rows but input_ids has batch size 1"):
        model(ids[:1, :1], cache=cache)
    other = LatentMoEForCausalLM(tiny_config.replace(layer_types=["dsa", "kda", "kda", "dsa"])).eval()
    with pytest.raises(ValueError, match=r"cache: entry 0 is a KDALayerCache but layer 0 of the model is 'dsa'"):
        other(ids, cache=model.new_cache())
    deeper = LatentMoEForCausalLM(tiny_config.replace(num_layers=8)).eval()
    with pytest.raises(ValueError, match="cache: has 4 layer entries, the model has 8"):
        deeper(ids, cache=model.new_cache())
    with pytest.raises(TypeError, match="cache: expected a HybridCache"):
        model(ids, cache=[None] * 4)
