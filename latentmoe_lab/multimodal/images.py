"""From a user's image to vision-tower input: load, check, resize to whole merge windows, normalise, patchify.

    image (PIL, path, or tensor [C, H, W])
      -> float [C, H, W] in [0, 1]
      -> resized so H and W are multiples of u = patch * merge (nearest multiple, at least u)
      -> normalised to [-1, 1]
      -> patches [(H/p) (W/p), C p p] in merge-window order (see layers/vision.py)

An image is m x m merged windows of p x p patches, so it becomes (H/p)(W/p)/m^2 tokens of the text sequence.

Large files are handled before they cost memory: the pixel count is read from the header and checked
against `max_pixels` before anything is decoded (a 445 KB PNG of 12000 x 12000 pixels took 3.9 GB as
float), and an image far larger than `max_side` is shrunk while still 8-bit in PIL (JPEG draft decoding
at 1/2 .. 1/8 scale, then an integer box `reduce`) to no less than twice max_side, so only that smaller
image becomes float; the exact resize to whole merge windows stays the antialiased one in `patchify`.
PIL's own errors (not an image, truncated file) become ValueErrors naming the image.
"""
from __future__ import annotations

import math
import struct
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange


MAX_PIXELS = 50_000_000  # above a 48 MP photo; a 12000 x 12000 image (144 MP) is refused


def to_image_tensor(image, in_channels: int, name: str = "image", max_pixels: int = MAX_PIXELS,
                    max_side: int | None = None, min_side: int = 1) -> torch.Tensor:
    """A PIL image, an image file path, or a tensor [C, H, W] (uint8, or float in [0, 1]) -> float [C, H, W].

    `name` is used in error messages, e.g. "images[1]". Images of more than max_pixels pixels, or with a side
    shorter than min_side (the patch size), are refused at their own size (files before decoding). With
    max_side, a PIL image or file whose longer side exceeds 2 * max_side is shrunk in PIL first, to a longer
    side of at least 2 * max_side.
    """
    if isinstance(image, (str, Path)):
        image = _file_to_tensor(image, in_channels, name, max_pixels, max_side, min_side)
    elif _is_pil_image(image):
        image = _pil_to_tensor(image, in_channels, name, max_pixels, max_side, min_side)
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"{name}: expected a PIL image, a file path or a tensor [C, H, W], got {type(image).__name__}")
    if image.dim() != 3:
        raise ValueError(f"{name}: expected 3 dims [C, H, W], got shape {tuple(image.shape)}")
    if image.shape[0] != in_channels:
        raise ValueError(f"{name}: expected {in_channels} channels first [C={in_channels}, H, W], "
                         f"got shape {tuple(image.shape)}")
    _check_size(image.shape[2], image.shape[1], max_pixels, name, min_side)
    if image.dtype == torch.uint8:
        return image.float() / 255.0
    if not image.is_floating_point():
        raise TypeError(f"{name}: expected dtype uint8 or a floating dtype, got {image.dtype}")
    if not bool(torch.isfinite(image).all()):
        raise ValueError(f"{name}: contains NaN or inf")
    if image.numel() and (float(image.min()) < 0.0 or float(image.max()) > 1.0):
        raise ValueError(f"{name}: float pixels must lie in [0, 1], got range "
                         f"[{float(image.min()):.3g}, {float(image.max()):.3g}]")
    return image.float()


def grid_size(height: int, width: int, patch_size: int, merge_size: int,
              max_side: int | None = None, name: str = "image") -> tuple[int, int]:
    """(rows, cols) of patches an H x W image becomes: nearest multiple of patch*merge per side, >= one window.

    With max_side, a larger image is first scaled down (aspect kept) so its longer side is <= max_side.
    """
    _check_size(width, height, None, name, patch_size)
    scale = 1.0 if max_side is None else min(1.0, max_side / max(height, width))
    unit = patch_size * merge_size
    rows = max(1, round(height * scale / unit)) * merge_size
    cols = max(1, round(width * scale / unit)) * merge_size
    return rows, cols


def tokens_for_image(height: int, width: int, patch_size: int, merge_size: int, max_side: int | None = None) -> int:
    """Merged image tokens (placeholders) for an H x W image."""
    rows, cols = grid_size(height, width, patch_size, merge_size, max_side)
    return rows * cols // merge_size ** 2


def patchify(image: torch.Tensor, patch_size: int, merge_size: int, max_side: int | None = None,
             name: str = "image") -> tuple[torch.Tensor, tuple[int, int]]:
    """image float [C, H, W] in [0, 1] -> (patches [rows*cols, C*p*p] in [-1, 1], (rows, cols))."""
    height, width = image.shape[-2:]
    rows, cols = grid_size(height, width, patch_size, merge_size, max_side, name)
    size = (rows * patch_size, cols * patch_size)
    if (height, width) != size:
        image = F.interpolate(image[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    normalised = (image.clamp(0.0, 1.0) - 0.5) / 0.5
    patches = rearrange(normalised, "c (wr m1 p1) (wc m2 p2) -> (wr wc m1 m2) (c p1 p2)",
                        m1=merge_size, m2=merge_size, p1=patch_size, p2=patch_size)
    return patches, (rows, cols)


def unpatchify(patches: torch.Tensor, grid: tuple[int, int], patch_size: int, merge_size: int,
               in_channels: int) -> torch.Tensor:
    """Inverse of `patchify` for one image: patches [rows*cols, C*p*p] -> image [C, rows*p, cols*p] in [0, 1]."""
    rows, cols = grid
    image = rearrange(patches, "(wr wc m1 m2) (c p1 p2) -> c (wr m1 p1) (wc m2 p2)", wr=rows // merge_size,
                      wc=cols // merge_size, m1=merge_size, m2=merge_size, c=in_channels, p1=patch_size)
    return image * 0.5 + 0.5


def _is_pil_image(value) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def _check_size(width: int, height: int, max_pixels: int | None, name: str, min_side: int = 1) -> None:
    """Refuse an image with no pixels, a side under min_side, or more than max_pixels pixels (None: no limit)."""
    if min(width, height) < max(min_side, 1):
        what = "has no pixels" if min(width, height) == 0 else f"is smaller than one {min_side}x{min_side} patch"
        raise ValueError(f"{name}: {width}x{height} pixels (width x height) {what}")
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(f"{name}: {width}x{height} = {width * height / 1e6:.1f}M pixels is more than "
                         f"max_pixels = {max_pixels / 1e6:.1f}M; scale it down first")


def _pil_errors():
    from PIL import Image

    return OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError


def _file_to_tensor(path: str | Path, in_channels: int, name: str, max_pixels: int,
                    max_side: int | None, min_side: int) -> torch.Tensor:
    try:
        from PIL import Image
    except ImportError:
        raise TypeError(f"{name}: opening an image file needs Pillow (pip install pillow)") from None
    if not Path(path).is_file():
        raise ValueError(f"{name}: no image file at {str(path)!r}")
    try:
        with warnings.catch_warnings():  # PIL's bomb warning: max_pixels below decides, with a clearer message
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(path)  # reads the header only: size and format, no pixels yet
    except _pil_errors() as error:
        raise ValueError(f"{name}: {str(path)!r} is not a readable image ({error})") from None
    with opened:
        _check_size(*opened.size, max_pixels, name, min_side)
        keep = None if max_side is None else 2 * max_side
        if keep is not None and max(opened.size) > keep:  # a JPEG decodes straight at 1/2, 1/4 or 1/8 scale
            factor = max(opened.size) / keep
            opened.draft({1: "L", 3: "RGB"}.get(in_channels),
                         (math.ceil(opened.size[0] / factor), math.ceil(opened.size[1] / factor)))
        return _pil_to_tensor(opened, in_channels, name, max_pixels, max_side, min_side)


def _pil_to_tensor(image, in_channels: int, name: str, max_pixels: int, max_side: int | None,
                   min_side: int) -> torch.Tensor:
    """PIL image (possibly not decoded yet) -> uint8 [C, H, W]; converted to RGB (3 channels) or L (1 channel),
    after the size checks and, with max_side, box-reduced while still 8-bit (never below 2 * max_side)."""
    modes = {1: "L", 3: "RGB"}
    if in_channels not in modes:
        raise ValueError(f"in_channels: PIL images can become 1 or 3 channels, the vision tower wants {in_channels}")
    _check_size(*image.size, max_pixels, name, min_side)  # at the image's own size, before any reduction
    keep = None if max_side is None else 2 * max_side  # smallest longer side worth keeping
    try:
        image = image.convert(modes[in_channels])  # decodes a file opened lazily; a new image either way
        if keep is not None and max(image.size) >= 2 * keep:
            image = image.reduce(max(image.size) // keep)
    except _pil_errors() as error:
        raise ValueError(f"{name}: the image could not be decoded ({error})") from None
    width, height = image.size
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return rearrange(data, "(h w c) -> c h w", h=height, w=width, c=in_channels)
