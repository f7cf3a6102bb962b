"""The HTML summary of one chrome trace: heaviest ops, time by labelled component, memory over time.

Everything is read back from the trace file itself (profiling/trace.py), so a summary can be rebuilt
from any trace the profiler wrote, on any machine.
"""
from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from latentmoe_lab.profiling.labels import exclusive_seconds, label_seconds
from latentmoe_lab.profiling.trace import load_chrome_trace
from latentmoe_lab.report import Captioned, write_html_report

DEVICE_TYPES = {0: "CPU", 1: "CUDA"}  # "Device Type" of the profiler's [memory] events


def trace_summary(trace: dict, row_limit: int = 15) -> dict:
    """{"wall_s", "top_ops": [(name, self s)], "components": {label: exclusive s}, "memory": {device: [(t_s, bytes)]}}.

    wall_s is the recorded span of the profiler (the traced call); top ops are aten-level ops ("cpu_op"
    spans) by exclusive time; memory is the allocator's running "Total Allocated", t from the first event.
    """
    events = trace["traceEvents"]
    ops = exclusive_seconds(events, lambda e: e.get("cat") == "cpu_op")
    top = sorted(ops.items(), key=lambda item: item[1], reverse=True)[:row_limit]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "Trace"] or \
            [e for e in events if e.get("ph") == "X"]
    start = min(float(e["ts"]) for e in spans)
    wall = max(float(e["ts"]) + float(e["dur"]) for e in spans) - start
    memory: dict[str, list[tuple[float, int]]] = {}
    for event in events:
        if event.get("name") == "[memory]" and "Total Allocated" in event.get("args", {}):
            device = DEVICE_TYPES.get(event["args"].get("Device Type"), str(event["args"].get("Device Type")))
            memory.setdefault(device, []).append(((float(event["ts"]) - start) * 1e-6,
                                                  int(event["args"]["Total Allocated"])))
    for points in memory.values():
        points.sort()
    return {"wall_s": wall * 1e-6, "top_ops": top, "components": label_seconds(events), "memory": memory}


def write_trace_summary(trace_path: str | Path, html_path: str | Path, title: str) -> Path:
    """Write the HTML summary of the chrome trace at trace_path; returns html_path."""
    summary = trace_summary(load_chrome_trace(trace_path))
    components = sorted(summary["components"].items(), key=lambda item: item[1], reverse=True)
    labelled = sum(seconds for _, seconds in components)
    text = (f"trace: {Path(trace_path).name} (open it in chrome://tracing or ui.perfetto.dev)\n"
            f"recorded call: {summary['wall_s'] * 1e3:.2f} ms; labelled components cover "
            f"{labelled * 1e3:.2f} ms\n\n" +
            "\n".join(f"{name:<20} {seconds * 1e3:10.3f} ms" for name, seconds in components))
    top = summary["top_ops"][::-1]
    ops = go.Figure(go.Bar(x=[s * 1e3 for _, s in top], y=[name for name, _ in top], orientation="h"))
    ops.update_layout(title="Heaviest ops (exclusive time)", xaxis_title="ms", height=120 + 24 * len(top))
    parts = go.Figure(go.Bar(x=[name for name, _ in components], y=[s * 1e3 for _, s in components]))
    parts.update_layout(title="Time by component (exclusive time of each record_function label)", yaxis_title="ms")
    memory = go.Figure([go.Scatter(x=[t * 1e3 for t, _ in points], y=[b / 2 ** 20 for _, b in points],
                                   mode="lines", line_shape="hv", name=device)
                        for device, points in summary["memory"].items()])
    memory.update_layout(title="Allocated memory during the call", xaxis_title="ms", yaxis_title="MiB")
    sections = [text, Captioned(ops, "The aten ops that took the most time, nested ops subtracted."),
                Captioned(parts, "Where the call's time went by model component (attn.*, moe.*, comm.*)."),
                Captioned(memory, "Allocator total after each allocation and free, per device.")]
    return write_html_report(html_path, title, sections)
