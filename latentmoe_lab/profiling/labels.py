"""The record_function labels the model carries, and seconds per label read back from a chrome trace.

The layers open `torch.profiler.record_function(label)` around each step, so a trace shows them as
"user_annotation" spans (they cost a few microseconds each when no profiler runs):

    attn.kda            the whole KDA layer (layers/kda.py)
    attn.dsa            the Gated DSA layer outside the two below: projections, cache append, output gate
    attn.dsa.indexer    the lightning indexer's scores and top-k selection
    attn.dsa.attend     attention over the selected (or all causal) positions
    moe                 the LatentMoE layer outside the steps below: latent down/up projections, latent norm
    moe.route           router logits and top-k selection
    moe.dispatch        tokens to their experts (a sort locally, the All-to-All start under expert parallelism)
    moe.experts         the routed experts' grouped SwiGLU (the fused strategy's per-tile gathers too)
    moe.combine         the weighted results back to their tokens (fused: each tile's, inside moe.experts)
    moe.shared          the shared experts
    comm.<op>           one collective of parallel/comm.py (comm.all_reduce, comm.all_to_all, ...)

Spans nest (the indexer runs inside attn.dsa.attend's query blocks); `label_seconds` gives each label
its exclusive time, so the values add up to the labelled time without counting anything twice.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

LABELS = ("attn.kda", "attn.dsa", "attn.dsa.indexer", "attn.dsa.attend", "moe", "moe.route", "moe.dispatch",
          "moe.experts", "moe.combine", "moe.shared")
COMM_PREFIX = "comm."


def is_label(name: str) -> bool:
    return name in LABELS or name.startswith(COMM_PREFIX)


def label_seconds(events: Iterable[Mapping]) -> dict[str, float]:
    """Exclusive seconds per label from chrome-trace events; labels that never ran are absent."""
    return exclusive_seconds(events, lambda event: is_label(str(event.get("name", ""))))


def exclusive_seconds(events: Iterable[Mapping], keep: Callable[[Mapping], bool]) -> dict[str, float]:
    """Exclusive seconds per name of the complete ("X") spans that `keep` accepts (ts/dur in microseconds).

    A span's exclusive time is its time minus that of the kept spans nested directly inside it on the
    same thread, so the values add up to the kept spans' covered time without counting anything twice.
    """
    by_thread: dict[tuple, list[Mapping]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and keep(event):
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    seconds: dict[str, float] = defaultdict(float)
    for spans in by_thread.values():
        spans.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[str, float]] = []  # (name, end time) of the open spans
        for span in spans:
            start, duration = float(span["ts"]), float(span["dur"])
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack:
                seconds[stack[-1][0]] -= duration * 1e-6  # the parent's exclusive time loses this child
            seconds[span["name"]] += duration * 1e-6
            stack.append((span["name"], start + duration))
    return dict(seconds)
