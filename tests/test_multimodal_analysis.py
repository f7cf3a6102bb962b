"""Synthetic data, the tiny training run, routing by modality, image costs and image-aware prefill chunking."""
import math

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.multimodal import (ImageTextProcessor, chance_accuracy, image_cost, image_spans, images_in_chunk,
                                      make_sample, make_samples, prefill_chunks, routing_by_modality, select_images,
                                      train_vqa)
from latentmoe_lab.multimodal.cost import cache_bytes_per_token
from latentmoe_lab.multimodal.synthetic import ANSWERS, shape_mask


def test_synthetic_samples_are_reproducible_and_answers_live_in_pixels():
    a, b = make_samples(6, ("colour", "shape", "digit"), size=28, seed=3), make_samples(6, ("colour", "shape", "digit"),
                                                                                         size=28, seed=3)
    assert all(torch.equal(x.image, y.image) and x.answer == y.answer for x, y in zip(a, b))
    assert [s.kind for s in a] == ["colour", "shape", "digit"] * 2
    for sample in a:
        assert sample.image.shape == (3, 28, 28) and 0 <= sample.image.min() and sample.image.max() <= 1
        assert sample.answer in ANSWERS[sample.kind] and sample.answer not in sample.prompt
    for kind, answers in ANSWERS.items():  # first answer tokens are distinct: one token decides
        assert len({answer.encode()[0] for answer in answers}) == len(answers), kind
    assert chance_accuracy(a) == pytest.approx((1 / 4 + 1 / 3 + 1 / 10) / 3)
    circle = shape_mask("circle", 40, (20, 20), 10)
    square = shape_mask("square", 40, (20, 20), 10)
    assert circle.sum() < square.sum() and not circle[10, 10] and square[10, 10]
    with pytest.raises(ValueError, match="kind: expected one of"):
        make_sample("texture")


def test_tiny_training_run_lowers_the_answer_loss():
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny")
    model = LatentMoEForCausalLM(config)
    result = train_vqa(model, ImageTextProcessor(config), steps=8, batch_size=6, image_size=28, eval_size=6)
    assert len(result.losses) == len(result.first_token_losses) == 8
    assert result.losses[-1] < 0.8 * result.losses[0]
    assert result.first_token_losses[-1] < result.first_token_losses[0]
    assert result.chance_loss == pytest.approx((math.log(4) + math.log(3)) / 2)
    assert 0 <= result.accuracy_after <= 1 and set(result.accuracy_by_kind) == {"colour", "shape"}


@torch.no_grad()
def test_routing_by_modality_counts_every_real_token_top_k_times(tiny_config):
    model = LatentMoEForCausalLM(tiny_config).eval()
    batch = ImageTextProcessor(tiny_config)(["<image>hello", "a longer text without any image"],
                                            [[torch.rand(3, 56, 56)], []])
    stats = routing_by_modality(model, batch)
    moe_layers = tiny_config.num_layers - tiny_config.first_dense_layers
    assert stats.text_load.shape == stats.image_load.shape == (moe_layers, tiny_config.moe.num_experts)
    assert stats.image_tokens == 4 and stats.text_tokens == sum(batch.lengths) - 4
    k = tiny_config.moe.top_k
    assert (stats.image_load.sum(1) == 4 * k).all() and (stats.text_load.sum(1) == stats.text_tokens * k).all()
    text, image = stats.fractions()
    torch.testing.assert_close(text.sum(1), torch.ones(moe_layers))
    overlap = torch.tensor(stats.overlap())
    assert ((0 <= overlap) & (overlap <= 1 + 1e-6)).all()
    assert all(0 <= s <= tiny_config.moe.num_experts for s in stats.shared_experts())
    assert "experts used by both modalities" in stats.summary()


def test_full_scale_image_cost():
    config = ModelConfig.from_preset("k3-2.8t")
    cost = image_cost(config, 1024, 1024)
    # 1024 / 28 = 36.6 -> 37 merge windows per side -> 74 x 74 patches of 14 px
    assert cost.patches == 74 * 74 and cost.image_tokens == 37 * 37 and cost.sequence_tokens == 37 * 37 + 2
    per_token = 24 * ((512 + 64) * 2 + 128 * 1 + 4)  # 24 DSA layers: bf16 latent + rope, fp8 index key + scale
    assert cache_bytes_per_token(config) == per_token and cost.cache_bytes == (37 * 37 + 2) * per_token
    assert image_cost(config, 2048, 2048).tower_flops > 4 * cost.tower_flops  # attention grows quadratically
    with pytest.raises(ValueError, match="smaller than one 14x14 patch"):
        image_cost(config, 10, 1000)


@torch.no_grad()
def test_prefill_chunks_keep_images_whole_and_match_one_forward(tiny_config):
    # top-k above the prompt length: chunked and one-pass index scores differ in the last bits, which
    # could flip a near-tie in a real top-k selection; this test is about feeding images chunk by chunk
    tiny_config = tiny_config.replace(indexer={**vars(tiny_config.indexer), "topk": 64})
    model = LatentMoEForCausalLM(tiny_config).eval()
    processor = ImageTextProcessor(tiny_config)
    batch = processor("intro <image> middle text <image> end of it", [torch.rand(3, 56, 56), torch.rand(3, 84, 56)])
    ids = batch.input_ids[0]
    spans = image_spans(ids, tiny_config.vision)
    assert [end - start for start, end in spans] == [4 + 2, 6 + 2]
    naive = prefill_chunks(ids, 8, tiny_config.vision, keep_images_whole=False)
    assert any(start < cut < end for cut in (c[1] for c in naive) for start, end in spans)  # naive cuts an image
    chunks = prefill_chunks(ids, 8, tiny_config.vision)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(ids)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(chunks, chunks[1:]))
    assert not any(start < cut < end for cut in (c[1] for c in chunks) for start, end in spans)

    full = model(**batch.model_inputs()).logits
    cache, pieces = model.new_cache(), []
    for start, end in chunks:
        pixel_values, grids = select_images(batch.pixel_values, batch.image_grids, images_in_chunk(spans, start, end))
        pieces.append(model(ids[None, start:end], pixel_values, cache, grids).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cuts image 0"):
        images_in_chunk(spans, 0, spans[0][0] + 2)
