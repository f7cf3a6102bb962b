"""Issue 12 item 5: padded prompts of unequal length generate exactly what each prompt gives alone."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.multimodal import ImageTextProcessor

PAD = 0


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


def _left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = True
    return ids, mask


def _alone(model, prompt, **kwargs):
    return model.generate(prompt[None], **kwargs)[0]


def test_left_padded_batch_equals_each_prompt_alone(model, tiny_config):
    prompts = [torch.randint(1, tiny_config.vocab_size, (n,)) for n in (5, 11, 1)]
    ids, mask = _left_padded(prompts)
    out = model.generate(ids, max_new_tokens=5, attention_mask=mask)
    assert out.shape == (3, 11 + 5)
    for row, prompt in enumerate(prompts):
        assert torch.equal(out[row, 11 - len(prompt):], _alone(model, prompt, max_new_tokens=5))
        assert torch.equal(out[row, :11 - len(prompt)], torch.full((11 - len(prompt),), PAD))
    # right padding (what the processor makes) gives the same, left-padded, output
    right = torch.full_like(ids, PAD)
    for row, prompt in enumerate(prompts):
        right[row, :len(prompt)] = prompt
    assert torch.equal(model.generate(right, max_new_tokens=5, attention_mask=right != PAD), out)


def test_rows_that_stop_at_eos_are_filled_with_it(model, tiny_config):
    prompts = [torch.randint(1, tiny_config.vocab_size, (n,)) for n in (4, 7)]
    eos = int(_alone(model, prompts[0], max_new_tokens=2)[-1])  # row 0 stops after its second token
    ids, mask = _left_padded(prompts)
    out = model.generate(ids, max_new_tokens=6, eos_token_id=eos, attention_mask=mask)
    first_alone = _alone(model, prompts[0], max_new_tokens=6, eos_token_id=eos)
    second_alone = _alone(model, prompts[1], max_new_tokens=6, eos_token_id=eos)
    assert torch.equal(out[1, 7 - len(prompts[1]):][:len(second_alone)], second_alone)
    assert torch.equal(out[0, 3:3 + len(first_alone)], first_alone)
    assert out.shape[1] > 3 + len(first_alone) and (out[0, 3 + len(first_alone):] == eos).all()


def test_processor_batches_with_images_generate_like_each_sample_alone(model, tiny_config):
    processor = ImageTextProcessor(tiny_config)
    texts = ["<image>colour?", "a longer question: <image> then <image>, which?", "no image at all"]
    images = [[torch.rand(3, 28, 28)], [torch.rand(3, 56, 28), torch.rand(3, 28, 56)], []]
    batch = processor(texts, images)
    assert "attention_mask" in batch.model_inputs() and not bool(batch.attention_mask.all())
    out = model.generate(**batch.model_inputs(), max_new_tokens=4)
    width = batch.input_ids.shape[1]
    for row, (text, sample_images) in enumerate(zip(texts, images)):
        alone = processor(text, sample_images)
        expected = model.generate(**alone.model_inputs(), max_new_tokens=4)[0]
        assert torch.equal(out[row, width - (len(expected) - 4):width], expected[:-4])  # the prompt, left-padded
        assert torch.equal(out[row, width:], expected[-4:])  # its new tokens
    # the forward still takes the right-padded batch: real tokens get the logits they have alone
    logits = model(**batch.model_inputs()).logits
    alone = model(**processor(texts[0], images[0]).model_inputs()).logits[0]
    torch.testing.assert_close(logits[0, :alone.shape[0]], alone, atol=1e-4, rtol=1e-4)


def test_bad_masks_are_refused(model, tiny_config):
    ids = torch.randint(1, tiny_config.vocab_size, (2, 6))
    holes = torch.tensor([[1, 1, 0, 1, 1, 1], [1] * 6])
    with pytest.raises(ValueError, match="attention_mask: row 0 must be one run of real tokens"):
        model.generate(ids, max_new_tokens=2, attention_mask=holes)
    with pytest.raises(ValueError, match="attention_mask: row 1 has no real token"):
        model.generate(ids, max_new_tokens=2, attention_mask=torch.tensor([[1] * 6, [0] * 6]))
    with pytest.raises(ValueError, match="attention_mask: entries must be 0 / 1"):
        model.generate(ids, max_new_tokens=2, attention_mask=torch.full((2, 6), 2))
    with pytest.raises(ValueError, match="attention_mask: expected the shape of input_ids"):
        model.generate(ids, max_new_tokens=2, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6], dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask: row 0 is left-padded"):
        model(ids, attention_mask=left)
    with pytest.raises(ValueError, match="padded rows cannot continue a cache"):
        model(ids, attention_mask=left.flip(1), cache=model.new_cache())
