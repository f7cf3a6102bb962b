"""Which layer first differs, for a request verify found divergent (docs/design.md §19, §8's alignment taps).

The engine's passes are replayed exactly (same workload, same engines, same injection) with the alignment
taps recording every forward's per-token outputs (each layer's attention, FFN and residual) and a log of
each step's batch layout: which request's tokens, from which position, sit where in the step's packed
row. That gives, for the divergent request, the engine's own value of every tap at every position it
computed itself (a prefix hit's positions came from the cache and have none; a recomputed position keeps
its last value). The reference is one full forward over the prompt and the engine's tokens up to the
divergence, tapped the same way. The first tap, in forward order, whose values differ at some position by
more than REL_TOLERANCE (max |a - b| / max |b| over the hidden axis) is named.

    StepLog                      wraps one engine's runner.run: [(engine key, request id, start, n)] per step
    first_divergent_tap(...)     -> "layers.3.attn at position 41" or None
"""
from __future__ import annotations

import torch

from latentmoe_lab.alignment.taps import record_taps

REL_TOLERANCE = 1e-3
KINDS = ("attn", "ffn", "residual")


class StepLog:
    """The token layout of every step the wrapped engines ran, in forward order (the taps' token order)."""

    def __init__(self):
        self.segments: list[tuple[int, int, int, int]] = []  # (engine key, request id, start position, n)

    def wrap(self, engine, key: int) -> None:
        run = engine.runner.run

        def logged_run(batch):
            self.segments += [(key, seq.request_id, seq.num_computed, n) for seq, n in batch.entries]
            return run(batch)

        engine.runner.run = logged_run


def tapped_names(model) -> list[str]:
    from latentmoe_lab.alignment.taps import model_parts, tap_points

    return [p.name for p in tap_points(model_parts(model)[0]) if p.kind in KINDS]


def recording_context(model):
    """record_taps limited to the per-token layer taps (what the engine computes at every position)."""
    return record_taps(model, only=tapped_names(model))


def engine_rows(recording, log: StepLog, sources: list[tuple[int, int]]) -> dict[int, int]:
    """position -> index along the recording's token axis of the request's LAST computation of it."""
    rows, offset = {}, 0
    for key, request_id, start, n in log.segments:
        if (key, request_id) in sources:
            for i in range(n):
                rows[start + i] = offset + i
        offset += n
    return rows


@torch.no_grad()
def first_divergent_tap(model, recording, rows: dict[int, int], token_ids: list[int]) -> str | None:
    """Compare the engine's recorded taps at `rows` with a full forward over token_ids; the first tap that differs."""
    positions = sorted(p for p in rows if p < len(token_ids))
    if not positions:
        return None
    with recording_context(model) as reference:
        model(torch.tensor([token_ids], dtype=torch.int64))
    index = torch.tensor([rows[p] for p in positions])
    for name in reference.names():
        if name not in recording:
            continue
        ours = recording[name][0, index].float()
        theirs = reference[name][0, positions].float()
        scale = theirs.abs().amax(dim=-1).clamp_min(1e-12)
        rel = (ours - theirs).abs().amax(dim=-1) / scale
        worst = int(rel.argmax())
        if float(rel[worst]) > REL_TOLERANCE:
            return f"{name} at position {positions[worst]} (relative error {float(rel[worst]):.2e})"
    return None
