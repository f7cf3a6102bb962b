"""Procedural images with questions whose answers live only in the pixels.

Every image is drawn with plain tensor masks (no fonts, no files, identical on every machine):
one coloured shape (square, circle, triangle) or one coloured digit (a 3x5 bitmap font, scaled up)
on a noisy grey background, at a random place and size. The question names only the attribute
asked for ("What colour is the shape?"); the answer is a single word. Every answer within one
kind starts with a different byte, so the first answer token alone tells which one a model picked,
and chance accuracy is 1 / (number of answers of that kind).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

COLOURS = {"red": (0.90, 0.12, 0.10), "green": (0.10, 0.75, 0.20), "blue": (0.15, 0.30, 0.95),
           "yellow": (0.95, 0.85, 0.10)}
SHAPES = ("square", "circle", "triangle")
DIGITS = tuple("0123456789")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "Which shape is it?", "digit": "Which digit is drawn?"}
ANSWERS = {"colour": tuple(COLOURS), "shape": SHAPES, "digit": DIGITS}

# 3 columns x 5 rows per digit, row by row.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111",
}


@dataclass
class SyntheticSample:
    """One image [3, size, size] in [0, 1] with a question about it and its one-word answer."""

    image: torch.Tensor
    kind: str  # "colour", "shape" or "digit"
    question: str
    answer: str
    colour: str
    shape: str | None  # None when a digit is drawn
    digit: str | None  # None when a shape is drawn

    @property
    def prompt(self) -> str:
        """The text the model reads before answering (the image goes first)."""
        return f"<image>{self.question} "

    @property
    def text(self) -> str:
        """Prompt and answer: a training sequence."""
        return f"{self.prompt}{self.answer}."


def shape_mask(shape: str, size: int, centre: tuple[float, float], radius: float) -> torch.Tensor:
    """Boolean [size, size] mask of a square, circle or (upward) triangle."""
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {SHAPES}, got {shape!r}")
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dy, dx = ys - centre[0], xs - centre[1]
    if shape == "square":
        return (dy.abs() <= radius) & (dx.abs() <= radius)
    if shape == "circle":
        return dy ** 2 + dx ** 2 <= radius ** 2
    # apex at the top, base at the bottom: the half-width grows linearly with depth
    depth = dy + radius
    return (depth >= 0) & (depth <= 2 * radius) & (dx.abs() <= depth / 2)


def digit_mask(digit: str, size: int, top_left: tuple[int, int], cell: int) -> torch.Tensor:
    """Boolean [size, size] mask of a digit drawn from the 3x5 font with `cell` x `cell` pixel blocks."""
    if digit not in _FONT:
        raise ValueError(f"digit: expected one of {DIGITS}, got {digit!r}")
    glyph = torch.tensor([int(bit) for bit in _FONT[digit]], dtype=torch.bool).view(5, 3)
    big = glyph.repeat_interleave(cell, dim=0).repeat_interleave(cell, dim=1)
    mask = torch.zeros(size, size, dtype=torch.bool)
    top, left = top_left
    mask[top:top + big.shape[0], left:left + big.shape[1]] = big
    return mask


def make_sample(kind: str, size: int = 56, generator: torch.Generator | None = None) -> SyntheticSample:
    """One random sample of the given question kind on a size x size image."""
    if kind not in QUESTIONS:
        raise ValueError(f"kind: expected one of {tuple(QUESTIONS)}, got {kind!r}")
    if size < 16:
        raise ValueError(f"size: images need at least 16 pixels per side, got {size}")

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=generator))

    colour = pick(tuple(COLOURS))
    shape = digit = None
    if kind == "digit":
        digit = pick(DIGITS)
        cell = max(1, int(uniform(0.08, 0.14) * size))
        top = int(uniform(0, size - 5 * cell))
        left = int(uniform(0, size - 3 * cell))
        mask = digit_mask(digit, size, (top, left), cell)
    else:
        shape = pick(SHAPES)
        radius = uniform(0.2, 0.35) * size
        centre = (uniform(radius, size - radius), uniform(radius, size - radius))
        mask = shape_mask(shape, size, centre, radius)
    background = uniform(0.3, 0.6) + 0.05 * torch.randn(3, size, size, generator=generator)
    ink = torch.tensor(COLOURS[colour])[:, None, None].expand(3, size, size)
    image = torch.where(mask, ink, background).clamp(0.0, 1.0)
    answer = {"colour": colour, "shape": shape, "digit": digit}[kind]
    return SyntheticSample(image=image, kind=kind, question=QUESTIONS[kind], answer=answer,
                           colour=colour, shape=shape, digit=digit)


def make_samples(count: int, kinds: tuple[str, ...] = ("colour", "shape"), size: int = 56,
                 seed: int = 0) -> list[SyntheticSample]:
    """`count` samples, question kinds taken in turn, reproducible from `seed`."""
    if not kinds:
        raise ValueError("kinds: expected at least one question kind")
    generator = torch.Generator().manual_seed(seed)
    return [make_sample(kinds[i % len(kinds)], size, generator) for i in range(count)]


def chance_accuracy(samples: list[SyntheticSample]) -> float:
    """Expected accuracy of guessing uniformly among each question's possible answers."""
    return sum(1.0 / len(ANSWERS[s.kind]) for s in samples) / len(samples)
