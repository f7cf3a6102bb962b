"""Profiling (the profiling/ row of docs/design.md §2): where the time goes, as numbers and as a chrome trace.

    components.py   wall seconds per model component (module hooks) and the heaviest ops
    labels.py       the record_function labels the layers carry, and time by label from a trace
    trace.py        trace(fn, path): one call of fn under torch.profiler, written as a chrome trace
    steps.py        prefill / decode / training-step / engine-step callables to trace
    summary.py      the HTML summary of a trace: top ops, time by component, memory timeline
    cli.py          `latentmoe-lab profile --preset ... --mode prefill|decode|train|engine`
"""
from latentmoe_lab.profiling.components import (COMPONENTS, component_modules, component_timer,
                                                prefill_decode_profile, top_ops)
from latentmoe_lab.profiling.labels import LABELS, label_seconds
from latentmoe_lab.profiling.trace import load_chrome_trace, trace, validate_chrome_trace

__all__ = ["COMPONENTS", "LABELS", "component_modules", "component_timer", "label_seconds", "load_chrome_trace",
           "prefill_decode_profile", "top_ops", "trace", "validate_chrome_trace"]
