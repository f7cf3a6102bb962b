"""Issue 12 items 9 and 10 (grid sides): big images are refused or shrunk before they cost memory,
PIL's errors name the image, and image-grid sides are bounded before their product can wrap."""
import pytest
import torch
from PIL import Image, ImageFile

from latentmoe_lab.layers.vision import VisionTower
from latentmoe_lab.multimodal import ImageTextProcessor
from latentmoe_lab.multimodal.images import patchify, to_image_tensor


def _gradient(width, height):
    x = torch.linspace(0, 255, width).to(torch.uint8)[None, :, None].expand(height, width, 3).clone()
    x[..., 1] = torch.linspace(0, 255, height).to(torch.uint8)[:, None]
    return Image.fromarray(x.numpy())


def test_a_huge_png_is_refused_before_it_is_decoded(tiny_config, tmp_path, monkeypatch):
    path = tmp_path / "huge.png"
    Image.new("1", (12000, 12000)).save(path)  # 144M pixels in a few KB
    assert path.stat().st_size < 100_000

    def no_decoding(self):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    processor = ImageTextProcessor(tiny_config)
    with pytest.raises(ValueError, match=r"^images\[0\]\[0\]: 12000x12000 = 144.0M pixels is more than max_pixels"):
        processor("<image>", [path])


@pytest.mark.parametrize("suffix", ["png", "jpg"])
def test_large_images_shrink_in_pil_before_they_become_float(tiny_config, tmp_path, suffix):
    path = tmp_path / f"big.{suffix}"
    picture = _gradient(3000, 2000)
    picture.save(path, quality=95) if suffix == "jpg" else picture.save(path)
    shrunk = to_image_tensor(path, 3, max_side=256)  # PIL keeps a longer side in [512, 1024)
    assert shrunk.dtype == torch.float32 and 512 <= max(shrunk.shape[1:]) < 1024
    processor = ImageTextProcessor(tiny_config, max_side=256)
    patches, grid = processor.image_patches(path)
    with Image.open(path) as opened:
        full = torch.frombuffer(bytearray(opened.convert("RGB").tobytes()), dtype=torch.uint8)
    full = full.reshape(2000, 3000, 3).permute(2, 0, 1)
    reference, reference_grid = patchify(full.float() / 255, 14, 2, max_side=256)  # no PIL shrink
    assert grid == reference_grid
    assert (patches - reference).abs().mean() < 0.01


def test_pil_errors_name_the_image(tiny_config, tmp_path):
    good = tmp_path / "good.png"
    Image.fromarray(torch.randint(0, 256, (64, 64, 3), dtype=torch.uint8).numpy()).save(good)  # 12 KB of noise
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:6000])
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("hello")
    processor = ImageTextProcessor(tiny_config)
    with pytest.raises(ValueError, match=r"^images\[0\]\[1\]: the image could not be decoded"):
        processor(["<image><image>", "<image>"], [[good, truncated], [good]])
    with pytest.raises(ValueError, match=r"^images\[1\]\[0\]: .*notes.png' is not a readable image"):
        processor(["<image>", "<image>"], [[good], [not_an_image]])
    with pytest.raises(ValueError, match=r"^images\[0\]\[0\]: 20x20 = 0.0M pixels is more than max_pixels"):
        ImageTextProcessor(tiny_config, max_pixels=100)("<image>", [torch.rand(3, 20, 20)])


def test_grid_sides_are_bounded_before_their_product(tiny_config):
    tower = VisionTower(tiny_config)
    patch_dim = 3 * 14 * 14
    grids = torch.tensor([[2 ** 32, 2 ** 32], [2, 2]])  # 2^64 wraps to 0 in int64: 0 + 4 "matched" 4 patches
    with pytest.raises(ValueError, match="image_grids: a side of 4294967296 patches exceeds the 4 patches"):
        tower.check_inputs(torch.zeros(4, patch_dim), grids)


def test_empty_and_thin_images_are_named_at_their_own_size(tiny_config, tmp_path):
    """An empty PIL image names the image (not numpy's buffer message); a 1 x 100000 PNG is reported as
    1x100000, not at the size PIL's reduction would leave it."""
    thin = tmp_path / "thin.png"
    Image.new("RGB", (1, 100_000)).save(thin)
    processor = ImageTextProcessor(tiny_config)
    with pytest.raises(ValueError, match=r"^images\[0\]\[0\]: 0x0 pixels \(width x height\) has no pixels$"):
        processor("<image>", [Image.new("RGB", (0, 0))])
    with pytest.raises(ValueError, match=r"^images\[0\]\[0\]: 1x100000 pixels \(width x height\) is smaller than "
                                         r"one 14x14 patch$"):
        processor("<image>", [thin])
    with pytest.raises(ValueError, match=r"^image: 5x0 pixels \(width x height\) has no pixels$"):
        to_image_tensor(torch.zeros(3, 0, 5), 3)
