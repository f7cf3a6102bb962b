"""SamplingParams and per-request sampling (docs/design.md §6.5, §6.6).

Each request samples from its own torch.Generator, seeded from its seed, one draw per generated token,
so the tokens it gets do not depend on which other requests shared its steps. temperature 0 is greedy
(argmax, no draw); the generator is then untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate at most; stop_token_ids: a sampled one ends the request (it is kept
    as the last generated token). top_k None / top_p 1.0 keep every token; seed None = the request id."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k: must be None or an integer >= 1, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ValueError(f"seed: must be None or an integer >= 0, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids: must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: [vocab] fp32 of one sequence -> the next token id."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p  # mass before the token already reaches top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
