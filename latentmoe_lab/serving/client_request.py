"""A request as a front end holds it around an engine: the server's EngineWorker (server/worker.py) and the
router of a disaggregated service (disagg/router.py). Each hands the request's events to its `deliver`
callback and, after a failure, submits it again with the tokens so far (resumed). The engine's own view of a
request is its Sequence (sequence.py).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from latentmoe_lab.serving.sampling import SamplingParams


@dataclass(frozen=True)
class RequestEvent:
    """What a request's deliver callback gets: new token ids (with their logprobs when asked for; the prompt's
    logprobs once, before or with its first token), or the end (finish_reason, error)."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    source: tuple[str, str] | None = None  # disaggregated: (role, instance name) that made the tokens or the end


@dataclass(eq=False)
class ClientRequest:
    key: int
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[RequestEvent], None]
    accepted: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    def resumed(self) -> tuple[list[int], SamplingParams]:
        """Prompt + tokens so far, and the params for the rest (a recompute after a failure): the generator is
        seeded from (seed, tokens so far), so greedy outputs equal an unfaulted run and seeded ones stay
        reproducible; the prompt's logprobs went out with the first token."""
        if not self.generated:
            return self.prompt_ids, self.params
        seed = None if self.params.seed is None else (self.params.seed * 1_000_003 + len(self.generated)) % 2**63
        params = dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(self.generated),
                                     seed=seed, prompt_logprobs=None)
        return self.prompt_ids + self.generated, params
