"""Planted corruptions for `latentmoe-lab verify --inject NAME`: real mistakes public engines shipped, each put
at the one place it would happen, so a verify run that passes is known to be able to fail (docs/design.md §19).

    zero-kda-state      a restored or transferred KDA state set to zero (conv tail kept): after a prefix hit's
                        snapshot copy into the sequence's slot; in a P/D payload
    attention-only-hit  a prefix hit restores the DSA rows (shared blocks) but not the KDA snapshot: the copy
                        of the snapshot into the sequence's slot is skipped, the slot keeps what it held
    drop-conv-tail      the short-conv history lost on a move: zeroed after a hit's snapshot copy; in a P/D payload
    shift-snapshot      a snapshot taken one step late: the copy of a slot into a snapshot row runs after the
                        sequence's NEXT step (one token late in decode), so the row holds a later state
    stale-spec-slot     after a verify step that accepted drafts the sequence keeps the slot of token 0 (the
                        state after the last committed token only), so its next step starts from a stale state

Cost when off: nothing. The serving code has no hook, flag or branch for these: an injection wraps the
`copy_slot` attribute of ONE engine's scheduler, or the `step` of one engine, or swaps scheduler.keep_slot_of
inside a `with` block, or rewrites a RequestCache on its way between two engines, and only when verify is
given --inject. No serving module imports this one (tests/test_verify.py checks that).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

from latentmoe_lab.serving import scheduler as scheduler_module

INJECTIONS = ("zero-kda-state", "attention-only-hit", "drop-conv-tail", "shift-snapshot", "stale-spec-slot")
# which of the file's paths each injection needs: at least one must be on (names from drive.file_paths)
NEEDS = {"zero-kda-state": ("prefix hit", "p/d import"), "attention-only-hit": ("prefix hit",),
         "drop-conv-tail": ("prefix hit", "p/d import"), "shift-snapshot": ("prefix hit",),
         "stale-spec-slot": ("spec verify",)}


def check_injection(name: str | None, paths_on: list[str]) -> None:
    """ValueError naming the choices for an unknown injection, or the paths for one the file cannot exercise."""
    if name is None:
        return
    if name not in INJECTIONS:
        raise ValueError(f"--inject: unknown injection {name!r}; choose one of {', '.join(INJECTIONS)}")
    if not any(path in paths_on for path in NEEDS[name]):
        raise ValueError(f"--inject: {name} corrupts the {' or '.join(NEEDS[name])} path, which this service file "
                         f"does not turn on (its paths: {', '.join(paths_on)})")


class Injector:
    """Builds engines with the injection installed, and corrupts P/D payloads; a no-op when name is None."""

    def __init__(self, name: str | None):
        self.name = name

    def engine(self, make_engine: Callable) -> Callable:
        """make_engine(model, service) -> the same engine with this injection wrapped around its one place."""
        def build(model, service):
            engine = make_engine(model, service)
            if self.name in ("zero-kda-state", "attention-only-hit", "drop-conv-tail"):
                _wrap_restores(engine, self.name)
            elif self.name == "shift-snapshot":
                _delay_snapshots(engine)
            return engine
        return build

    def payload(self, cache):
        """A P/D RequestCache as the decode side receives it (zeroed KDA state or conv tail when injected)."""
        if self.name == "zero-kda-state":
            return dataclasses.replace(cache, kda_state=torch.zeros_like(cache.kda_state))
        if self.name == "drop-conv-tail":
            return dataclasses.replace(cache, kda_conv=torch.zeros_like(cache.kda_conv))
        return cache

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The process-wide part (stale-spec-slot swaps the scheduler's slot choice), undone on exit."""
        if self.name != "stale-spec-slot":
            yield
            return
        original = scheduler_module.keep_slot_of
        scheduler_module.keep_slot_of = lambda seq, accepted: original(seq, 0)
        try:
            yield
        finally:
            scheduler_module.keep_slot_of = original


def _wrap_restores(engine, name: str) -> None:
    """A prefix hit copies a snapshot row (>= num_slots) into a running slot (< num_slots): corrupt that copy."""
    scheduler, runner = engine.scheduler, engine.runner
    copy = scheduler.copy_slot
    num_slots = engine.block_manager.num_slots

    def corrupted_copy(src: int, dst: int) -> None:
        restore = src >= num_slots > dst
        if not (restore and name == "attention-only-hit"):
            copy(src, dst)
        if restore and name != "attention-only-hit":
            empty = torch.zeros(0, dtype=torch.int64)
            rows = runner.read_rows(empty, dst)
            rows["kda_state" if name == "zero-kda-state" else "kda_conv"].zero_()
            runner.write_rows(empty, dst, rows)

    scheduler.copy_slot = corrupted_copy


def _delay_snapshots(engine) -> None:
    """Copies of a running slot into a snapshot row run after the engine's next step instead of now."""
    scheduler, num_slots = engine.scheduler, engine.block_manager.num_slots
    copy, step = scheduler.copy_slot, engine.step
    queued: list[tuple[int, int]] = []

    def delayed_copy(src: int, dst: int) -> None:
        if src < num_slots <= dst:
            queued.append((src, dst))
        else:
            copy(src, dst)

    def step_then_snapshot():
        due = list(queued)
        queued.clear()
        outputs = step()
        for src, dst in due:
            copy(src, dst)
        return outputs

    scheduler.copy_slot = delayed_copy
    engine.step = step_then_snapshot
