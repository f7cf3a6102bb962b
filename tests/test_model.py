import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig


@pytest.fixture
def tiny_model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


def test_forward_shapes_and_finite(tiny_model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (2, 37))
    logits = tiny_model(ids).logits
    assert logits.shape == (2, 37, tiny_config.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@torch.no_grad()
@pytest.mark.parametrize("prefill_splits", [[45], [20, 25], [1, 44]])
def test_prefill_then_decode_matches_full_forward(tiny_model, tiny_config, prefill_splits):
    # 45 + 6 tokens > index_topk (32): the DSA layer really selects a subset.
    ids = torch.randint(0, tiny_config.vocab_size, (2, 51))
    full = tiny_model(ids).logits
    cache = tiny_model.new_cache()
    pieces, start = [], 0
    for length in prefill_splits + [1] * 6:
        pieces.append(tiny_model(ids[:, start:start + length], cache=cache).logits)
        start += length
    assert cache.seq_len == 51
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_greedy_generate_matches_uncached_argmax_loop(tiny_model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (2, 9))
    generated = tiny_model.generate(ids, max_new_tokens=5)
    expected = ids
    for _ in range(5):
        next_token = tiny_model(expected).logits[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected)


@torch.no_grad()
def test_sampling_is_reproducible_and_top_k_one_is_greedy(tiny_model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 6))
    a = tiny_model.generate(ids, 6, do_sample=True, generator=torch.Generator().manual_seed(3))
    b = tiny_model.generate(ids, 6, do_sample=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    top1 = tiny_model.generate(ids, 6, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(5))
    assert torch.equal(top1, tiny_model.generate(ids, 6))
    nucleus = tiny_model.generate(ids, 6, do_sample=True, top_p=1e-6, generator=torch.Generator().manual_seed(5))
    assert torch.equal(nucleus, top1)


@torch.no_grad()
def test_generate_stops_at_eos(tiny_model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 4))
    first = int(tiny_model.generate(ids, 1)[0, -1])
    out = tiny_model.generate(ids, 10, eos_token_id=first)
    assert out.shape == (1, 5) and int(out[0, -1]) == first


def test_training_step_reduces_loss(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_small_preset_backward_is_finite():
    model = LatentMoEForCausalLM(ModelConfig.from_preset("small"))
    ids = torch.randint(0, model.config.vocab_size, (1, 33))
    logits = model(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, param in model.named_parameters():
        if ".indexer." in name:  # top-k selection is not differentiable: the indexer trains on its own loss
            assert param.grad is None, name
        elif name.startswith("vision."):  # a text-only batch never runs the vision tower
            assert param.grad is None, name
        else:
            assert param.grad is not None and torch.isfinite(param.grad).all(), name


@pytest.mark.parametrize("bad, error, match", [
    (torch.zeros(2, 3), TypeError, "input_ids"),
    (torch.zeros(3, dtype=torch.long), ValueError, "input_ids"),
    (torch.full((1, 3), 10_000), ValueError, r"input_ids: token ids must lie in \[0, 512\)"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "input_ids"),
])
def test_bad_input_ids_are_refused(tiny_model, bad, error, match):
    with pytest.raises(error, match=match):
        tiny_model(bad)


def test_bad_generate_arguments_are_refused(tiny_model):
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_model.generate(ids, max_new_tokens=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_model.generate(ids, max_new_tokens=10_000)
    with pytest.raises(ValueError, match="temperature"):
        tiny_model.generate(ids, 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        tiny_model.generate(ids, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="pixel_values"):
        tiny_model(ids, pixel_values=torch.zeros(1, 3, 28, 28))
