"""Padded prompt batches for model.generate: each row is run alone, the outputs left-padded back.

A padding token in front of a prompt would enter the KDA state, the short conv and the DSA keys of
that row, so a padded batch cannot simply run as one tensor. generate is the plain reference path:
it takes the real tokens of each row (and that row's images), generates for them alone, and lays
the results out left-padded, so out[:, T:] holds every row's new tokens and each row equals its
prompt run alone. Batching rows of different lengths together (ragged batching) is the serving
engine's job (docs/design.md §6.4).

attention_mask [B, T] (bool or 0/1 ints) marks real tokens; each row's real tokens form one run at
the left (right padding, what the multimodal processor makes) or at the right (left padding).
"""
from __future__ import annotations

import torch


def prompt_spans(attention_mask, input_ids: torch.Tensor) -> list[tuple[int, int]] | None:
    """Validate the mask; (start, end) of each row's real tokens, or None when nothing is padded."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a tensor [B, T], got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.is_floating_point() or attention_mask.is_complex() or \
                bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask: entries must be 0 / 1 (or bool)")
        attention_mask = attention_mask != 0
    mask = attention_mask.cpu()
    if bool(mask.all()):
        return None
    lengths = mask.sum(dim=1)
    starts = mask.int().argmax(dim=1)  # first real token
    spans = []
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        end = start + length
        if length == 0:
            raise ValueError(f"attention_mask: row {row} has no real token")
        if not bool(mask[row, start:end].all()) or (start != 0 and end != mask.shape[1]):
            raise ValueError(f"attention_mask: row {row} must be one run of real tokens at the start (right "
                             f"padding) or at the end (left padding); padding inside a prompt is not supported")
        spans.append((start, end))
    return spans


def split_images(input_ids: torch.Tensor, spans: list[tuple[int, int]], image_token_id: int,
                 pixel_values: torch.Tensor | None, image_grids: torch.Tensor | None,
                 tokens_per_image: torch.Tensor | None) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per row, (pixel_values, image_grids) of the images whose placeholders lie in that row's span.

    Images are in placeholder order, row after row (as the processor makes them); tokens_per_image [I]
    comes from the vision tower. pixel_values holds rows * cols patches per image, image after image.
    """
    if pixel_values is None:
        return [(None, None)] * len(spans)
    patch_end = (image_grids[:, 0] * image_grids[:, 1]).cumsum(0).tolist()
    token_end = tokens_per_image.cumsum(0).tolist()
    out, image, used_tokens = [], 0, 0
    for row, (start, end) in enumerate(spans):
        wanted = used_tokens + int((input_ids[row, start:end] == image_token_id).sum())
        first = image
        while image < len(token_end) and token_end[image] <= wanted:
            image += 1
        if (token_end[image - 1] if image else 0) != wanted:
            raise ValueError(f"input_ids: the image placeholders of row {row} do not match whole images of "
                             f"image_grids (images are taken in order, row after row)")
        used_tokens = wanted
        if image == first:
            out.append((None, None))
            continue
        patch_start = patch_end[first - 1] if first else 0
        out.append((pixel_values[patch_start:patch_end[image - 1]], image_grids[first:image]))
    if image != len(token_end):
        raise ValueError(f"pixel_values: {len(token_end) - image} images have no placeholders in the real tokens")
    return out


def left_pad_rows(rows: list[torch.Tensor], pads: list[torch.Tensor], eos_token_id: int | None) -> torch.Tensor:
    """Rows [T_b + n_b] -> [B, T + max n]: row b left-padded with its own pad tokens pads[b] (T - T_b of
    them) and, when it stopped early at eos (only then is it shorter), right-filled with eos_token_id."""
    width = max(pad.numel() + row.numel() for row, pad in zip(rows, pads))
    out = []
    for row, pad in zip(rows, pads):
        tail = row.new_full((width - pad.numel() - row.numel(),), 0 if eos_token_id is None else eos_token_id)
        out.append(torch.cat([pad.to(row.dtype), row, tail]))
    return torch.stack(out)
