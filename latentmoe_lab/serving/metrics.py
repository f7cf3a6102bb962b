"""Latency metrics per request, a record per step, and p50 / p90 / p99 summaries (docs/design.md §6.6).

Every time comes from time.monotonic() (never the wall clock, which can jump).

    queue time  first scheduled - arrival
    TTFT        first generated token - arrival
    TPOT        (last token - first token) / (generated - 1): the mean decode interval
    ITL         every interval between two consecutive generated tokens
    e2e         finish - arrival
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from latentmoe_lab.serving.sequence import Sequence


@dataclass
class RequestMetrics:
    """Seconds; tpot is None with fewer than 2 generated tokens, ttft None with none."""

    queue_time: float | None
    ttft: float | None
    tpot: float | None
    itl: list[float]
    e2e: float | None
    prompt_tokens: int
    generated_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    spec_accepted_tokens: int = 0  # drafts of speculative decoding accepted over the request's life

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        times = seq.token_times
        itl = [b - a for a, b in zip(times, times[1:])]
        return cls(
            queue_time=None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time,
            ttft=times[0] - seq.arrival_time if times else None,
            tpot=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            itl=itl,
            e2e=None if seq.finish_time is None else seq.finish_time - seq.arrival_time,
            prompt_tokens=len(seq.prompt_ids), generated_tokens=len(seq.generated_ids),
            prefix_hit_tokens=seq.prefix_hit_tokens, preemptions=seq.num_preemptions,
            spec_accepted_tokens=seq.spec_accepted_tokens,
        )


@dataclass
class StepRecord:
    """One engine step: when, how long, what ran, what the cache held afterwards."""

    time: float
    duration: float
    schedule_time: float  # scheduler + batch metadata, the part that is not the model forward
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    blocks_used: int
    slots_used: int
    preemptions: int  # in this step
    prefix_hit_tokens: int  # total so far
    prefill_chunks: int = 0  # sequences that ran prompt tokens in this step (the others decoded)


DEFAULT_MAX_RECORDS = 100_000  # a long benchmark's worth; a server keeps far fewer (Prometheus has the history)


class MetricsLog:
    """The latest `max_records` step records and finished-request metrics, oldest first.

    Bounded so that a long-running engine (a server, a soak) does not grow by a record per step forever;
    older records drop off the front. Both are deques: iterate, len() or list(...)[a:b] them.
    """

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS):
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"max_records: must be an integer >= 1, got {max_records!r}")
        self.steps: deque[StepRecord] = deque(maxlen=max_records)
        self.requests: deque[RequestMetrics] = deque(maxlen=max_records)


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., 'p90': ..., 'p99': ..., 'mean': ...} (linear interpolation); NaN for no values."""
    if not values:
        return {f"p{q:g}": float("nan") for q in qs} | {"mean": float("nan")}
    data = torch.tensor(values, dtype=torch.float64)
    out = {f"p{q:g}": float(torch.quantile(data, q / 100)) for q in qs}
    return out | {"mean": float(data.mean())}


def summarize(requests: list[RequestMetrics]) -> dict[str, dict[str, float]]:
    """Per metric name (queue_time, ttft, tpot, itl, e2e) its percentiles over the requests (ITL: every interval)."""
    def present(name):
        return [getattr(r, name) for r in requests if getattr(r, name) is not None]

    return {"queue_time": percentiles(present("queue_time")), "ttft": percentiles(present("ttft")),
            "tpot": percentiles(present("tpot")), "itl": percentiles([x for r in requests for x in r.itl]),
            "e2e": percentiles(present("e2e"))}


def format_table(summary: dict[str, dict[str, float]]) -> str:
    """The summary as a text table in milliseconds."""
    columns = list(next(iter(summary.values())))
    lines = [f"{'metric (ms)':<14}" + "".join(f"{c:>11}" for c in columns)]
    for name, stats in summary.items():
        lines.append(f"{name:<14}" + "".join(f"{stats[c] * 1e3:>11.1f}" for c in columns))
    return "\n".join(lines)
