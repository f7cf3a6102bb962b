"""Drive a server worker (EngineWorker or DisaggWorker) through timed arrivals, as the HTTP handlers would,
and record each request's token times (benchmarks/bench_disagg.py and the disaggregated serve-bench).

The worker's submit(prompt_ids, params, deliver) is what the handlers call, so the figures leave out HTTP and
client parsing. Every time is time.monotonic(), the clock the instance processes' step logs use too.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from latentmoe_lab.serving.bench_workload import WorkloadRequest


@dataclass
class DrivenRequest:
    """One request's life as its client saw it (monotonic seconds)."""

    prompt_tokens: int
    submitted: float = float("nan")
    key: int = -1  # the worker's request key
    times: list[float] = field(default_factory=list)  # one per generated token
    ids: list[int] = field(default_factory=list)
    end: float | None = None
    reason: str | None = None
    error: str | None = None


def drive(worker, requests: list[WorkloadRequest], timeout_s: float = 1800.0, progress=None) -> list[DrivenRequest]:
    """Submit each request (token ids) at its arrival time after the start; wait until every one finished.

    RuntimeError if they do not within timeout_s; a refused submit (QueueFullError ...) raises as it is.
    progress: anything with update(), called once per finished request.
    """
    for i, request in enumerate(requests):
        if not isinstance(request.prompt, list):
            raise ValueError(f"requests[{i}].prompt: the worker takes token ids, got {type(request.prompt).__name__}")
    done = threading.Event()
    records = [DrivenRequest(len(r.prompt)) for r in requests]
    left = [len(requests)]
    lock = threading.Lock()

    def deliver(record: DrivenRequest):
        def on_event(event) -> None:
            now = time.monotonic()
            record.times += [now] * len(event.token_ids)
            record.ids += event.token_ids
            if event.finished:
                record.end, record.reason, record.error = now, event.finish_reason, event.error
                if progress is not None:
                    progress.update()
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return on_event

    start = time.monotonic()
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival):
        time.sleep(max(0.0, start + requests[i].arrival - time.monotonic()))
        records[i].submitted = time.monotonic()
        records[i].key = worker.submit(requests[i].prompt, requests[i].params, deliver(records[i])).result(timeout=60)
    if not done.wait(timeout=timeout_s):
        raise RuntimeError(f"the workload did not finish within {timeout_s:g} s: {left[0]} of {len(requests)} "
                           f"requests still running")
    return records
