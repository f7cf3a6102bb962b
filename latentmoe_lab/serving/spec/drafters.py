"""The drafter interface and the n-gram (prompt lookup) drafter.

A drafter proposes up to K tokens that may follow a request's tokens; the target model then checks them
all in one forward (docs/design.md §12). Every drafter answers `propose(request_id, DraftInput, k)` and
forgets a request on `release(request_id)` (finished, aborted or preempted: a recompute starts again);
`propose_batch` takes a step's requests at once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftInput:
    """tokens: the request's tokens, prompt + generated; the last one has not run through the target yet.
    hidden [n, hidden_size]: the target's last hidden state (before its final norm) at the positions it ran
    since this request's previous propose, in order (the MTP drafter's input; None for the n-gram one).
    For the MTP drafter both start at the request's first position with a hidden row: 0, or after a prefix
    hit or an import the position before the first one computed here (spec/hidden_rows.py)."""

    tokens: Sequence[int]
    hidden: torch.Tensor | None = None


class Drafter(ABC):
    """Proposes draft tokens for one request at a time."""

    name: str

    @abstractmethod
    def propose(self, request_id: int, draft_input: DraftInput, k: int) -> list[int]:
        """Up to k tokens that may follow draft_input.tokens (fewer, or none, when the drafter has no guess)."""

    def propose_batch(self, requests: list[tuple[int, DraftInput, int]]) -> list[list[int]]:
        """propose for every (request_id, DraftInput, k) of a step, in order; a drafter that can run them
        together (mtp_batched.py) overrides it."""
        return [self.propose(request_id, draft_input, k) for request_id, draft_input, k in requests]

    def release(self, request_id: int) -> None:
        """Forget what this drafter holds for the request (nothing for a stateless drafter)."""


class NgramDrafter(Drafter):
    """Prompt lookup: the longest suffix of the request's tokens, prompt_lookup_max down to prompt_lookup_min
    tokens long, that also occurs earlier in them proposes the up to k tokens that followed its most recent
    earlier occurrence. Stateless."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        for key, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: must be an integer >= 1, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min: {prompt_lookup_min} exceeds prompt_lookup_max {prompt_lookup_max}")
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, request_id: int, draft_input: DraftInput, k: int) -> list[int]:
        return ngram_proposal(draft_input.tokens, k, self.prompt_lookup_min, self.prompt_lookup_max)


def ngram_proposal(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The n-gram proposal for `tokens` (vectorised; tests compare it with a loop over every start).

    For n = lookup_max .. lookup_min: the windows tokens[i : i + n] with i + n < len(tokens) (an occurrence
    followed by at least one token, the suffix itself excluded) that equal the suffix tokens[-n:]; the
    largest such i proposes tokens[i + n : i + n + k]. No match at any n: [].
    """
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(lookup_max, len(ids) - 1), lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [len - n, n]: starts i <= len - 1 - n
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []
