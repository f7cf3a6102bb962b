"""The serve-bench report of a disaggregated service (docs/design.md §13.2): latencies per role, each instance's
steps over time and the transfers between them, and the numbers behind them as a Data section.

Inputs are records (server/drive.py's DrivenRequest, the instances' StepRecords, the router's TransferRecords),
all on one monotonic clock; times in the data are seconds since t0, the workload's start.

Per request of n generated tokens at times t_1..t_n, submitted at s:
    ttft (prefill)     t_1 - s: the prefill instance's first token (it streams before the payload leaves)
    handover           t_2 - t_1: the transfer, the import and the decode instance's first step
    tpot (decode)      (t_n - t_2) / (n - 2): the mean interval of the decode instance's tokens (as /metrics'
                       latentmoe_role_time_per_output_token_seconds)
    tpot (service)     (t_n - t_1) / (n - 1): what a client sees, as the colocated serve-bench's tpot
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from latentmoe_lab.report import Captioned, Data, Section
from latentmoe_lab.serving.metrics import format_table, percentiles
from latentmoe_lab.viz.disagg import instances_timeline_figure

DATA_NAME = "serve-bench-disagg"


def role_latencies(requests: Sequence, transfers: Sequence) -> dict[str, dict[str, float]]:
    """Metric name -> p50 / p90 / p99 / mean seconds over the finished requests (see the module's table)."""
    done = [r for r in requests if r.error is None and r.times]
    rows = {
        "ttft prefill": [r.times[0] - r.submitted for r in done],
        "handover": [r.times[1] - r.times[0] for r in done if len(r.times) > 1],
        "tpot decode": [(r.times[-1] - r.times[1]) / (len(r.times) - 2) for r in done if len(r.times) > 2],
        "tpot service": [(r.times[-1] - r.times[0]) / (len(r.times) - 1) for r in done if len(r.times) > 1],
        "itl": [b - a for r in done for a, b in zip(r.times, r.times[1:])],
        "e2e": [r.end - r.submitted for r in done],
        "transfer": [t.seconds for t in transfers],
    }
    return {name: percentiles(values) for name, values in rows.items()}


def instance_line(name: str, pid: int | None, steps: Sequence, elapsed: float) -> str:
    busy = sum(s.duration for s in steps)
    return (f"{name} (pid {pid}): {len(steps)} steps, {sum(s.prefill_chunks for s in steps)} prefill chunks "
            f"({sum(s.prefill_tokens for s in steps)} tokens), {sum(s.decode_tokens for s in steps)} decode tokens, "
            f"busy {busy:.2f} s of {elapsed:.2f} s")


def report_data(requests: Sequence, step_logs: Mapping[str, Sequence], transfers: Sequence, t0: float,
                pids: Mapping[str, int | None], counts: Mapping[str, float]) -> dict:
    """The numbers the report is drawn from (JSON-safe: no NaN; times relative to t0)."""
    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 6)

    return {
        "t0": t0,
        "requests": [{"key": r.key, "prompt_tokens": r.prompt_tokens, "generated_tokens": len(r.ids),
                      "submitted": since(r.submitted), "first_token": since(r.times[0] if r.times else None),
                      "end": since(r.end), "reason": r.reason, "error": r.error} for r in requests],
        "instances": {name: {"pid": pids.get(name), "steps": [
            {"end": since(s.time), "duration": round(s.duration, 6), "prefill_chunks": s.prefill_chunks,
             "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens, "running": s.running,
             "waiting": s.waiting, "blocks_used": s.blocks_used} for s in steps]}
            for name, steps in step_logs.items()},
        "transfers": [{"key": t.key, "source": t.source, "target": t.target, "bytes": t.size,
                       "start": since(t.start), "seconds": round(t.seconds, 6), "prompt_tokens": t.prompt_tokens}
                      for t in transfers],
        "counts": dict(counts),
    }


def disagg_report_sections(header: str, requests: Sequence, step_logs: Mapping[str, Sequence],
                           transfers: Sequence, t0: float, elapsed: float, pids: Mapping[str, int | None],
                           counts: Mapping[str, float]) -> list[Section]:
    """header, the per-role latency table (ms), one line per instance, the timelines, the data."""
    table = format_table(role_latencies(requests, transfers))
    lines = "\n".join(instance_line(name, pids.get(name), steps, elapsed) for name, steps in step_logs.items())
    figure = instances_timeline_figure(step_logs, transfers, t0)
    caption = ("Each instance's steps (bar width: the step's duration; hover: what it ran) and each request's "
               "transfer from export on the prefill instance to import on the decode instance: the prefill "
               "instance's long chunks never share a step with the decode instance's decodes.")
    return [header, table, lines, Captioned(figure, caption),
            Data(DATA_NAME, report_data(requests, step_logs, transfers, t0, pids, counts))]
