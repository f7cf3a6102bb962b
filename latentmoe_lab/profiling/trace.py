"""trace(fn, path): run fn once under torch.profiler and write a chrome trace (chrome://tracing, Perfetto).

The file is the profiler's own chrome-trace export: {"traceEvents": [...], ...}, each event a dict with
"ph" (phase: "X" complete span, "i" instant, "M" metadata, ...), "name", "pid", "tid" and "ts" (us);
"X" spans also carry "dur" (us). With memory profiling on, "[memory]" instant events carry the running
"Total Allocated" bytes. `validate_chrome_trace` checks exactly that schema.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from numbers import Real
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from latentmoe_lab.profiling.quiet import PROFILER_NOISE, native_stderr_without

PHASES = set("BEXIiCbneMPOND(sftRc")  # phases of the Trace Event Format


def trace(fn: Callable[[], object], path: str | Path, warmup: int = 1, profile_memory: bool = True) -> Path:
    """Call fn() `warmup` times, then once under torch.profiler (CPU, and CUDA when present); write the trace.

    Returns the path written (parent folders are created). Warm-up calls keep one-time costs (allocator
    growth, kernel compilation, lazy initialisation) out of the recorded call.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: must be an int >= 0, got {warmup!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    for _ in range(warmup):
        fn()
    if on_cuda:
        torch.cuda.synchronize()
    with native_stderr_without(PROFILER_NOISE), profile(activities=activities, profile_memory=profile_memory) as prof:
        fn()
        if on_cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path


def load_chrome_trace(path: str | Path) -> dict:
    """Read and validate a chrome trace file; returns the parsed dict."""
    data = json.loads(Path(path).read_text())
    validate_chrome_trace(data)
    return data


def validate_chrome_trace(data) -> None:
    """Raise ValueError naming the first event that breaks the Trace Event Format as chrome://tracing reads it."""
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError("trace: expected a JSON object with a 'traceEvents' list")
    if not data["traceEvents"]:
        raise ValueError("trace: 'traceEvents' is empty")
    for i, event in enumerate(data["traceEvents"]):
        if not isinstance(event, dict):
            raise ValueError(f"traceEvents[{i}]: expected an object, got {type(event).__name__}")
        phase = event.get("ph")
        if not isinstance(phase, str) or phase not in PHASES:
            raise ValueError(f"traceEvents[{i}].ph: expected one of the Trace Event Format phases, got {phase!r}")
        if not isinstance(event.get("name"), str):
            raise ValueError(f"traceEvents[{i}].name: expected a string, got {event.get('name')!r}")
        for key in ("pid", "tid"):
            if key in event and not isinstance(event[key], (str, int)):
                raise ValueError(f"traceEvents[{i}].{key}: expected an int or a string, got {event[key]!r}")
        if phase != "M" and not _number(event.get("ts")):
            raise ValueError(f"traceEvents[{i}].ts: expected a number of microseconds, got {event.get('ts')!r}")
        if phase == "X" and not (_number(event.get("dur")) and event["dur"] >= 0):
            raise ValueError(f"traceEvents[{i}].dur: a complete ('X') event needs a duration >= 0, "
                             f"got {event.get('dur')!r}")


def _number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
