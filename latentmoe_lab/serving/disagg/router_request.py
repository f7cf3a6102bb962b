"""A request as the router of a disaggregated service sees it, and its transfers (docs/design.md §13.2); the
events it hands back are client_request.RequestEvent, as the server's colocated worker's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from latentmoe_lab.serving.client_request import ClientRequest

if TYPE_CHECKING:
    from latentmoe_lab.serving.disagg.instance_handle import Instance


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
class RoutedRequest(ClientRequest):
    prefill: "Instance | None" = None  # holds it: computing, or its rows until the ack
    decode: "Instance | None" = None  # was sent its payload (imported once acked)
    payload: tuple | None = None  # (start, bytes) waiting for a decode instance
    exporter: str | None = None  # the prefill instance that sent the latest payload
    resends: int = 0
    recomputes: int = 0
    prompt_sent: int = 0  # the prompt the prefill instance computes (prompt + tokens so far on a recompute)

