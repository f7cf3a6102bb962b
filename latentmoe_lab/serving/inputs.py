"""Request inputs -> a Sequence, or a ValueError / TypeError that names what is wrong (docs/design.md §6.6).

A prompt is one of
    a list of token ids, or a 1-D / [1, T] int tensor;
    a string (the checkpoint's tokenizer.json, else bytes: tokenizer.load_tokenizer);
    a dict {"text": str, "images": [image, ...]} with one "<image>" marker per image (ImageTextProcessor), or
    a dict {"input_ids": ..., "pixel_values": [N, C*p*p], "image_grids": [I, 2]} (processor.model_inputs()).
"""
from __future__ import annotations

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.serving.sequence import ImageInputs, image_digest


def prompt_inputs(prompt, config: ModelConfig, tokenizer_dir=None) -> tuple[list[int], ImageInputs | None]:
    """(token ids, images or None) of one prompt; raises on anything malformed. tokenizer_dir: the checkpoint
    the model came from (model.name_or_path), whose tokenizer.json encodes text; None = the byte tokenizer."""
    if isinstance(prompt, str):
        prompt = {"text": prompt, "images": []}
    if isinstance(prompt, dict):
        return _from_dict(prompt, config, tokenizer_dir)
    return _token_ids(prompt, config), None


def _from_dict(prompt: dict, config: ModelConfig, tokenizer_dir=None) -> tuple[list[int], ImageInputs | None]:
    if "text" in prompt:
        unknown = sorted(set(prompt) - {"text", "images"})
        if unknown:
            raise ValueError(f"prompt.{unknown[0]}: unknown key; a text prompt takes 'text' and 'images'")
        if not isinstance(prompt["text"], str):
            raise TypeError(f"prompt.text: expected a string, got {type(prompt['text']).__name__}")
        images = prompt.get("images") or []
        if not images and not prompt["text"]:
            raise ValueError("prompt: empty text")
        if images and config.vision is None:
            raise ValueError("prompt.images: this model has no vision tower")
        from latentmoe_lab.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir, config.vocab_size)
        if not images:
            return _token_ids(tokenizer.encode(prompt["text"]), config), None
        from latentmoe_lab.multimodal.processor import ImageTextProcessor

        batch = ImageTextProcessor(config, tokenizer=tokenizer)(prompt["text"], list(images))
        prompt = {"input_ids": batch.input_ids, "pixel_values": batch.pixel_values, "image_grids": batch.image_grids}
    unknown = sorted(set(prompt) - {"input_ids", "pixel_values", "image_grids"})
    if unknown:
        raise ValueError(f"prompt.{unknown[0]}: unknown key; expected 'text' + 'images', or 'input_ids' "
                         f"(+ 'pixel_values' and 'image_grids')")
    if "input_ids" not in prompt:
        raise ValueError("prompt.input_ids: missing")
    ids = _token_ids(prompt["input_ids"], config)
    pixel_values, image_grids = prompt.get("pixel_values"), prompt.get("image_grids")
    if pixel_values is None and image_grids is None:
        return ids, None
    return ids, _image_inputs(ids, pixel_values, image_grids, config)


def _token_ids(ids, config: ModelConfig) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2) or \
                (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"prompt: a tensor prompt must be int [T] or [1, T], got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt: expected token ids, text or a dict, got {type(ids).__name__}")
    if not ids:
        raise ValueError("prompt: empty (no tokens)")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError("prompt: token ids must be integers")
    if min(ids) < 0 or max(ids) >= config.vocab_size:
        raise ValueError(f"prompt: token ids must lie in [0, {config.vocab_size}), got [{min(ids)}, {max(ids)}]")
    return list(ids)


def _image_inputs(ids: list[int], pixel_values, image_grids, config: ModelConfig) -> ImageInputs:
    """Check images against placeholders: each image's features fill one contiguous run of placeholders."""
    vision = config.vision
    if vision is None:
        raise ValueError("prompt.pixel_values: this model has no vision tower")
    if not isinstance(pixel_values, torch.Tensor) or not isinstance(image_grids, torch.Tensor):
        raise ValueError("prompt.pixel_values / image_grids: give both, as tensors [N, C*p*p] and [I, 2]")
    if image_grids.dim() != 2 or image_grids.shape[1] != 2 or image_grids.shape[0] == 0:
        raise ValueError(f"prompt.image_grids: expected [I, 2] with I >= 1, got {tuple(image_grids.shape)}")
    patches_per_image = (image_grids[:, 0] * image_grids[:, 1]).tolist()
    if pixel_values.dim() != 2 or pixel_values.shape[0] != sum(patches_per_image):
        raise ValueError(f"prompt.pixel_values: expected [{sum(patches_per_image)}, C*p*p] for grids "
                         f"{image_grids.tolist()}, got {tuple(pixel_values.shape)}")
    features_per_image = [n // vision.merge_size ** 2 for n in patches_per_image]
    positions = [p for p, t in enumerate(ids) if t == vision.image_token_id]
    if len(positions) != sum(features_per_image):
        raise ValueError(f"prompt: {len(image_grids)} images give {sum(features_per_image)} image features but the "
                         f"prompt holds {len(positions)} image placeholder tokens (id {vision.image_token_id})")
    spans, digests, cursor = [], [], 0
    for index, (count, patches) in enumerate(zip(features_per_image, pixel_values.split(patches_per_image))):
        run = positions[cursor:cursor + count]
        if run[-1] - run[0] + 1 != count:
            raise ValueError(f"prompt: the placeholders of image {index} are not one contiguous run")
        spans.append((run[0], run[-1] + 1))
        digests.append(image_digest(patches, image_grids[index]))
        cursor += count
    return ImageInputs(pixel_values=pixel_values, image_grids=image_grids.to(torch.int64), digests=digests,
                       spans=spans)
