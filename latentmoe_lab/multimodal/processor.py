"""Images + text -> one token sequence per sample, with image placeholders the model fills in.

A text marks where each image goes with "<image>". The processor turns every marker into

    <image_start> <image> x n <image_end>        n = (rows * cols) / m^2 merged patches of that image

and encodes the text around it with the byte tokenizer. All images of the batch go into one
`pixel_values` tensor (patches, image after image, in the order their markers appear, sample after
sample), with `image_grids` giving each image's (rows, cols) of patches. The model's vision tower
turns them into exactly one feature per placeholder, in the same order.

Samples of different lengths come out right-padded with <pad> (`attention_mask` marks real tokens);
`latentmoe_lab.multimodal.packing.pack` turns that into the varlen layout with `cu_seqlens`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.multimodal.images import MAX_PIXELS, patchify, to_image_tensor
from latentmoe_lab.tokenizer import PAD_TOKEN_ID, SPECIAL_TOKENS, ByteTokenizer

IMAGE_MARKER = "<image>"


@dataclass
class MultimodalBatch:
    """input_ids / attention_mask [B, T] (padded, or B = 1 packed); pixel_values [N, C*p*p]; image_grids [I, 2].

    cu_seqlens [S + 1] int64 is set only in the packed layout: sequence s is input_ids[0, cu[s]:cu[s+1]].
    images_per_sample [S]: how many images each sample holds, in order.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grids: torch.Tensor | None
    images_per_sample: list[int]
    cu_seqlens: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        """Real tokens per sample."""
        if self.cu_seqlens is not None:
            return self.cu_seqlens.diff().tolist()
        return self.attention_mask.sum(dim=1).tolist()

    def to(self, device: torch.device | str) -> "MultimodalBatch":
        """A copy with every tensor on `device`."""
        def move(t):
            return None if t is None else t.to(device)
        return MultimodalBatch(move(self.input_ids), move(self.attention_mask), move(self.pixel_values),
                               move(self.image_grids), list(self.images_per_sample), move(self.cu_seqlens))

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(...)` and `model.generate(...)`: attention_mask always (cu_seqlens
        instead when packed).

        The forward takes the right-padded rows as they are (a pad after a row changes none of its logits);
        generate runs each padded row alone and returns the rows left-padded, so out[:, T:] are the new
        tokens of every prompt (model.py, padded.py).
        """
        inputs = {"input_ids": self.input_ids, "pixel_values": self.pixel_values, "image_grids": self.image_grids}
        if self.cu_seqlens is not None:
            inputs["cu_seqlens"] = self.cu_seqlens
        else:
            inputs["attention_mask"] = self.attention_mask
        return inputs


class ImageTextProcessor:
    """processor(text, images) -> MultimodalBatch. Built from a ModelConfig that has a vision part.

    text: a string or a list of strings (one per sample). images: for one string, an image or a list of
    images; for a list of strings, a list holding one list of images per string. An image is a PIL image,
    a file path, or a tensor [C, H, W] (uint8, or float in [0, 1]); sizes may differ. Images larger than
    `max_side` pixels on their longer side are scaled down first (the tower's attention is quadratic);
    images of more than `max_pixels` pixels are refused before they are decoded (images.py).
    """

    def __init__(self, config: ModelConfig, max_side: int | None = 1024, max_pixels: int = MAX_PIXELS,
                 tokenizer=None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        if config.vision is None:
            raise ValueError("config.vision: the processor needs a config with a vision tower")
        if max(SPECIAL_TOKENS.values()) >= config.vocab_size:
            raise ValueError(f"config.vocab_size: needs room for the special tokens {SPECIAL_TOKENS}, "
                             f"got {config.vocab_size}")
        if max_side is not None and max_side < config.vision.patch_size:
            raise ValueError(f"max_side: must be None or >= patch_size ({config.vision.patch_size}), got {max_side}")
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
            raise ValueError(f"max_pixels: must be a positive integer, got {max_pixels!r}")
        self.vision = config.vision
        self.max_side = max_side
        self.max_pixels = max_pixels
        # tokenizer: what encodes the text pieces (a checkpoint's, tokenizer.tokenizer_of); None = bytes
        self.tokenizer = ByteTokenizer(config.vocab_size) if tokenizer is None else tokenizer
        self.pad_token_id = PAD_TOKEN_ID

    def __call__(self, text: str | list[str], images=None) -> MultimodalBatch:
        texts, images_per_text = _normalise_inputs(text, images)
        sequences, patches, grids = [], [], []
        for i, (sample_text, sample_images) in enumerate(zip(texts, images_per_text)):
            pieces = sample_text.split(IMAGE_MARKER)
            if len(pieces) - 1 != len(sample_images):
                raise ValueError(f"text[{i}]: has {len(pieces) - 1} {IMAGE_MARKER!r} markers but "
                                 f"{len(sample_images)} images were given for it")
            ids = self._encode(pieces[0])
            for j, (image, piece) in enumerate(zip(sample_images, pieces[1:])):
                image_patches, grid = self.image_patches(image, name=f"images[{i}][{j}]")
                patches.append(image_patches)
                grids.append(grid)
                ids += self.image_span(grid) + self._encode(piece)
            if not ids:
                raise ValueError(f"text[{i}]: the sample has no tokens (empty text and no images)")
            sequences.append(ids)
        input_ids, attention_mask = pad_sequences(sequences, self.pad_token_id)
        return MultimodalBatch(
            input_ids=input_ids, attention_mask=attention_mask,
            pixel_values=torch.cat(patches) if patches else None,
            image_grids=torch.tensor(grids, dtype=torch.int64) if grids else None,
            images_per_sample=[len(sample_images) for sample_images in images_per_text],
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)[0].tolist() if text else []

    def image_patches(self, image, name: str = "image") -> tuple[torch.Tensor, tuple[int, int]]:
        """One image -> (patches [rows*cols, C*p*p], (rows, cols))."""
        tensor = to_image_tensor(image, self.vision.in_channels, name, self.max_pixels, self.max_side,
                                 min_side=self.vision.patch_size)
        return patchify(tensor, self.vision.patch_size, self.vision.merge_size, self.max_side, name)

    def image_span(self, grid: tuple[int, int]) -> list[int]:
        """Token ids standing for one image of (rows, cols) patches: start, one placeholder per window, end."""
        count = grid[0] * grid[1] // self.vision.merge_size ** 2
        return [self.vision.image_start_id] + [self.vision.image_token_id] * count + [self.vision.image_end_id]

    def decode(self, ids) -> str:
        """Token ids -> text; image spans and padding print as their special-token names."""
        return self.tokenizer.decode(ids)


def pad_sequences(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (input_ids [B, T_max] int64, attention_mask [B, T_max] bool).

    Right padding keeps every real token at the position it has alone: causal attention and the
    KDA recurrence never look forward, so the padding cannot change a real token's output.
    """
    longest = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros(len(sequences), longest, dtype=torch.bool)
    for row, ids in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        attention_mask[row, :len(ids)] = True
    return input_ids, attention_mask


def _normalise_inputs(text, images) -> tuple[list[str], list[list]]:
    """(text, images) in any accepted form -> (texts [S], images per text [S][n_s])."""
    if isinstance(text, str):
        if images is None:
            images = []
        elif not isinstance(images, (list, tuple)):
            images = [images]
        return [text], [list(images)]
    if not isinstance(text, (list, tuple)) or not text or not all(isinstance(t, str) for t in text):
        raise TypeError("text: expected a string or a non-empty list of strings")
    if images is None:
        return list(text), [[] for _ in text]
    if not isinstance(images, (list, tuple)) or len(images) != len(text) or \
            not all(isinstance(per_text, (list, tuple)) for per_text in images):
        raise ValueError(f"images: with a list of {len(text)} texts, expected a list of {len(text)} lists "
                         f"of images (one list per text, [] for none)")
    return list(text), [list(per_text) for per_text in images]
