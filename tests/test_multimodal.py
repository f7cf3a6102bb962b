"""Processor, placeholder replacement, image-change locality, generate with an image, errors."""
import pytest
import torch
from PIL import Image

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.multimodal import ImageTextProcessor
from latentmoe_lab.tokenizer import PAD_TOKEN_ID, SPECIAL_TOKENS

START, IMAGE, END = SPECIAL_TOKENS["<image_start>"], SPECIAL_TOKENS["<image>"], SPECIAL_TOKENS["<image_end>"]


@pytest.fixture
def processor(tiny_config):
    return ImageTextProcessor(tiny_config)


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


def test_spans_counts_and_padding(processor):
    batch = processor(["a<image>b<image>", "<image>xyz"],
                      [[torch.rand(3, 56, 56), torch.rand(3, 28, 84)], [torch.rand(3, 40, 20)]])
    # 56x56 -> 4x4 patches -> 4 tokens; 28x84 -> 2x6 -> 3; 40x20 -> rounded to 28x28 -> 2x2 -> 1
    assert batch.image_grids.tolist() == [[4, 4], [2, 6], [2, 2]]
    assert batch.pixel_values.shape == (16 + 12 + 4, 3 * 14 * 14)
    a, b = ord("a"), ord("b")
    assert batch.input_ids[0].tolist() == [a, START, *[IMAGE] * 4, END, b, START, *[IMAGE] * 3, END]
    assert batch.input_ids[1].tolist() == [START, IMAGE, END, *b"xyz"] + [PAD_TOKEN_ID] * 7
    assert batch.lengths == [13, 6] and batch.images_per_sample == [2, 1]
    moved = batch.to("cpu")
    assert torch.equal(moved.pixel_values, batch.pixel_values) and moved.cu_seqlens is None
    assert processor.decode(batch.input_ids[1, :6]) == "<image_start><image><image_end>xyz"


def test_pil_images_paths_and_tensors_agree(processor, tmp_path):
    pixels = torch.randint(0, 256, (3, 28, 42), dtype=torch.uint8)
    image = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    image.save(tmp_path / "im.png")
    from_tensor = processor("<image>", pixels).pixel_values
    torch.testing.assert_close(processor("<image>", image).pixel_values, from_tensor)
    torch.testing.assert_close(processor("<image>", str(tmp_path / "im.png")).pixel_values, from_tensor)
    grey = Image.fromarray(pixels[0].numpy(), mode="L")  # converted to RGB: three equal channels
    converted = processor("<image>", grey).pixel_values.view(-1, 3, 14 * 14)
    torch.testing.assert_close(converted[:, 0], converted[:, 2])


@pytest.mark.parametrize("text, images, error, match", [
    ("two <image> <image>", [torch.rand(3, 28, 28)], ValueError, r"text\[0\]: has 2 '<image>' markers but 1"),
    ("<image>", [torch.rand(1, 28, 28)], ValueError, r"images\[0\]\[0\]: expected 3 channels first"),
    ("<image>", [torch.rand(28, 28, 3)], ValueError, r"images\[0\]\[0\]: expected 3 channels first"),
    ("<image>", [torch.rand(3, 10, 40)], ValueError, r"images\[0\]\[0\]: 40x10 pixels \(width x height\) is smaller than one 14x14"),
    ("<image>", [torch.rand(3, 28, 28) * 3], ValueError, r"float pixels must lie in \[0, 1\]"),
    ("<image>", [torch.zeros(3, 28, 28, dtype=torch.int32)], TypeError, "uint8"),
    ("<image>", ["/no/such/file.png"], ValueError, "no image file"),
    (["a", "b"], [[torch.rand(3, 28, 28)]], ValueError, "one list per text"),
    ("", None, ValueError, "no tokens"),
])
def test_processor_errors_name_the_argument(processor, text, images, error, match):
    with pytest.raises(error, match=match):
        processor(text, images)


@torch.no_grad()
def test_placeholders_are_replaced_in_order(model, processor):
    batch = processor(["x<image>y", "<image>z<image>"],
                      [[torch.rand(3, 28, 56)], [torch.rand(3, 56, 56), torch.rand(3, 28, 28)]])
    features = model.vision(batch.pixel_values, batch.image_grids)  # [2 + 4 + 1, hidden]
    embedded = model._embed(batch.input_ids, batch.pixel_values, batch.image_grids)
    placeholders = batch.input_ids == IMAGE
    torch.testing.assert_close(embedded[placeholders], features)
    torch.testing.assert_close(embedded[~placeholders], model.embed_tokens(batch.input_ids)[~placeholders])
    assert placeholders.sum(1).tolist() == [2, 5]


@torch.no_grad()
def test_placeholder_count_mismatches_are_refused(model, processor):
    batch = processor("<image> and <image>", [torch.rand(3, 28, 56), torch.rand(3, 56, 56)])
    fewer = batch.input_ids[:, batch.input_ids[0] != IMAGE]  # drop every placeholder
    with pytest.raises(ValueError, match="holds 0 image placeholder tokens but pixel_values give 6"):
        model(fewer, batch.pixel_values, image_grids=batch.image_grids)
    swapped = batch.image_grids.flip(0)  # totals agree (6), but image 0 has 2 placeholders, not 4
    pixel_values = torch.cat([batch.pixel_values[8:], batch.pixel_values[:8]])
    with pytest.raises(ValueError, match=r"image 0 has 2 placeholder tokens but its grid \[4, 4\] gives 4"):
        model(batch.input_ids, pixel_values, image_grids=swapped)
    with pytest.raises(ValueError, match="image_grids: required with pixel_values"):
        model(batch.input_ids, batch.pixel_values)
    with pytest.raises(ValueError, match="image_grids: given without pixel_values"):
        model(batch.input_ids, image_grids=batch.image_grids)


@torch.no_grad()
def test_changing_an_image_changes_logits_only_at_and_after_its_tokens(model, processor):
    first, second = torch.rand(3, 28, 56), torch.rand(3, 56, 28)
    text = "look<image>then<image>end"
    before = model(**processor(text, [first, second]).model_inputs()).logits
    after = model(**processor(text, [first, torch.rand(3, 56, 28)]).model_inputs()).logits
    ids = processor(text, [first, second]).input_ids[0]
    second_start = int((ids == IMAGE).nonzero()[2])  # the first image has 2 placeholders
    # equal up to float reassociation (the batched matmuls group rows differently), then clearly different
    torch.testing.assert_close(after[:, :second_start], before[:, :second_start], atol=1e-5, rtol=0)
    assert (after[0, second_start:] - before[0, second_start:]).abs().amax(-1).min() > 1e-3


@torch.no_grad()
def test_generate_with_an_image_matches_the_uncached_loop(model, processor):
    batch = processor("<image>What colour?", torch.rand(3, 56, 56))
    out = model.generate(**batch.model_inputs(), max_new_tokens=4)
    expected = batch.input_ids
    for _ in range(4):
        logits = model(expected, batch.pixel_values, image_grids=batch.image_grids).logits
        expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)
