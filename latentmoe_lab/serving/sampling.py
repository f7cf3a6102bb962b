"""SamplingParams and per-request sampling (docs/design.md §6.5, §6.6).

Each request samples from its own torch.Generator, seeded from its seed, one draw per generated token,
so the tokens it gets do not depend on which other requests shared its steps. temperature 0 is greedy
(argmax, no draw); so is any temperature below GREEDY_BELOW (1e-5, the floor the public servers use),
where dividing by it would overflow the logits to inf and the softmax to NaN.

Before the choice (greedy or drawn), the logits get the OpenAI adjustments, in this order:

    logits[t] += logit_bias[t]                                   (bias in [-100, 100])
    logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]

where count[t] is how often t occurs among the request's generated tokens (not its prompt). Logprobs
(serving/logprobs.py) are taken from the raw model logits, before these adjustments, the temperature
and top-k / top-p, as the public servers return them by default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy
MAX_LOGPROBS = 20  # alternatives per position, as the OpenAI API allows
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as the OpenAI API allows
MAX_BIAS = 100.0  # |logit_bias| values
SEED_LIMIT = 2**64  # torch generators take seeds in [0, 2^64)


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate at most (0: run the prompt only, for its prompt_logprobs);
    stop_token_ids: a sampled one ends the request (it is kept as the last generated token). top_k None /
    top_p 1.0 keep every token; seed None = the request id. logprobs k: each generated token's logprob
    and its k most likely alternatives (0: the token's alone); prompt_logprobs k: the same for every prompt
    token but the first (the request then takes no prefix-cache hit: those positions must run).
    logit_bias: ((token id, bias), ...)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens: must be an integer >= 0 (0 = the prompt only), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and not _is_int(self.top_k, 1):
            raise ValueError(f"top_k: must be None or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed, 0) and self.seed < SEED_LIMIT):
            raise ValueError(f"seed: must be None or an integer in [0, 2^64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value, 0) and value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}: must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        stops = tuple(self.stop_token_ids)
        if not all(_is_int(t, 0) for t in stops):
            raise ValueError(f"stop_token_ids: must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        bias = tuple((t, float(b)) for t, b in (dict(self.logit_bias).items() if isinstance(self.logit_bias, dict)
                                               else self.logit_bias))
        if not all(_is_int(t, 0) and _is_number(b) and -MAX_BIAS <= b <= MAX_BIAS for t, b in bias):
            raise ValueError(f"logit_bias: must map token ids (integers >= 0) to numbers in [-{MAX_BIAS:g}, "
                             f"{MAX_BIAS:g}]")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """logits [vocab] fp32 + logit_bias - presence / frequency penalties over the generated ids (a new tensor)."""
    logits = logits.float().clone()
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        logits[list(ids)] += torch.tensor(values, dtype=torch.float32)
    if generated and (params.presence_penalty != 0 or params.frequency_penalty != 0):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.shape[-1])
        counts = counts[:logits.shape[-1]].float()
        logits -= params.presence_penalty * (counts > 0).float() + params.frequency_penalty * counts
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 generated: list[int] = ()) -> int:
    """logits: [vocab] fp32 of one sequence; generated: its tokens so far (for the penalties) -> the next id."""
    if params.greedy:
        return greedy_token(logits, params, generated)
    return int(torch.multinomial(target_probs(logits, params, generated), 1, generator=generator))


def greedy_token(logits: torch.Tensor, params: SamplingParams, generated: list[int] = ()) -> int:
    """The argmax of the adjusted logits [vocab] (what a greedy request emits)."""
    if params.adjusts_logits:
        logits = adjusted_logits(logits, params, list(generated))
    return int(logits.argmax())


def target_probs(logits: torch.Tensor, params: SamplingParams, generated: list[int] = ()) -> torch.Tensor:
    """The distribution [vocab] fp32 a sampling (non-greedy) request draws its next token from: adjusted
    logits, temperature, top-k, top-p, softmax. Speculative verification accepts drafts against it."""
    if params.adjusts_logits:
        logits = adjusted_logits(logits, params, list(generated))
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p  # mass before the token already reaches top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


def _is_int(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
