"""Chunked prefill of an interleaved sequence: where may a chunk end when images sit in the text?

Long prompts are prefilled in chunks over the cache (KDA carries its state, DSA appends its latent
cache). Text can be cut anywhere. An image span can be cut too, numerically, but then the vision
tower's features for the image must be computed once and handed out across two chunks; a chunk
whose placeholders do not match whole images cannot be fed as pixels. The simpler policy keeps every
image span inside one chunk: a boundary that would fall inside a span moves back to the span's start
(or, for a span that starts the chunk and is longer than the chunk, forward to its end). Chunks become
uneven, and one huge image can make one chunk much larger than the rest; `chunk_sizes` shows by how much.
"""
from __future__ import annotations

import torch

from latentmoe_lab.config import VisionConfig


def image_spans(input_ids: torch.Tensor, vision: VisionConfig) -> list[tuple[int, int]]:
    """input_ids [T] of one sequence -> half-open (start, end) of each image span, start through end token."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids: expected one sequence [T], got shape {tuple(input_ids.shape)}")
    starts = (input_ids == vision.image_start_id).nonzero().flatten().tolist()
    ends = (input_ids == vision.image_end_id).nonzero().flatten().tolist()
    if len(starts) != len(ends) or any(s >= e for s, e in zip(starts, ends)) or \
            any(e >= s for e, s in zip(ends, starts[1:])):
        raise ValueError(f"input_ids: image start tokens at {starts} and end tokens at {ends} do not pair up")
    return [(s, e + 1) for s, e in zip(starts, ends)]


def prefill_chunks(input_ids: torch.Tensor, chunk_size: int, vision: VisionConfig,
                   keep_images_whole: bool = True) -> list[tuple[int, int]]:
    """Half-open (start, end) chunks covering input_ids [T], at most chunk_size long unless an image forces more."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be a positive integer, got {chunk_size!r}")
    spans = image_spans(input_ids, vision) if keep_images_whole else []
    total, pos, chunks = input_ids.shape[0], 0, []
    while pos < total:
        end = min(pos + chunk_size, total)
        for span_start, span_end in spans:
            if span_start < end < span_end:  # the cut would fall inside this image
                end = span_start if span_start > pos else span_end
                break
        chunks.append((pos, end))
        pos = end
    return chunks


def images_in_chunk(spans: list[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the images whose spans lie inside [start, end); raises if a span is cut by the chunk."""
    inside = []
    for index, (span_start, span_end) in enumerate(spans):
        if start <= span_start and span_end <= end:
            inside.append(index)
        elif span_start < end and start < span_end:
            raise ValueError(f"chunk [{start}, {end}): cuts image {index} spanning [{span_start}, {span_end})")
    return inside


def select_images(pixel_values: torch.Tensor, image_grids: torch.Tensor,
                  indices: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The patches [N', C*p*p] and grids [I', 2] of the chosen images (None, None when there are none)."""
    if not indices:
        return None, None
    per_image = pixel_values.split((image_grids[:, 0] * image_grids[:, 1]).tolist())
    return torch.cat([per_image[i] for i in indices]), image_grids[indices]


def chunk_sizes(chunks: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in chunks]
