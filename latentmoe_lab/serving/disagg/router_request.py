"""A request as the router of a disaggregated service sees it, and the events it hands back (docs/design.md §13.2)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from latentmoe_lab.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from latentmoe_lab.serving.disagg.instance_handle import Instance


@dataclass(frozen=True)
class RequestEvent:
    """What a request's deliver callback gets (the server's Event has the same fields)."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    source: tuple[str, str] | None = None  # (role, instance name) that made the tokens or the end


@dataclass(frozen=True)
class TransferRecord:
    """One acknowledged cache transfer: export start on `source` (a prefill instance) to import done on `target`
    (a decode instance), on the machine's monotonic clock (one for every process)."""

    key: int
    size: int  # payload bytes
    start: float
    seconds: float
    prompt_tokens: int
    source: str
    target: str


@dataclass(eq=False)
class RoutedRequest:
    key: int
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[RequestEvent], None]
    accepted: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prefill: "Instance | None" = None  # holds it: computing, or its rows until the ack
    decode: "Instance | None" = None  # was sent its payload (imported once acked)
    payload: tuple | None = None  # (start, bytes) waiting for a decode instance
    exporter: str | None = None  # the prefill instance that sent the latest payload
    resends: int = 0
    recomputes: int = 0
    prompt_sent: int = 0  # the prompt the prefill instance computes (prompt + tokens so far on a recompute)

    def resumed(self) -> tuple[list[int], SamplingParams]:
        """Prompt + tokens so far and the params of the rest (a recompute)."""
        if not self.generated:
            return self.prompt_ids, self.params
        seed = None if self.params.seed is None else (self.params.seed * 1_000_003 + len(self.generated)) % 2**63
        params = dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(self.generated),
                                     seed=seed, prompt_logprobs=None)
        return self.prompt_ids + self.generated, params
