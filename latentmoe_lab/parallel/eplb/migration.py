"""Expert migration off the step path, on one worker (docs/design.md §14).

The engine's OnlineBalancer hands each changed MoE layer out twice, in two consecutive step headers that
every rank receives alike (the header is broadcast):

    step n      {"stage":  {layer: phy2log row [P]}}   a side thread builds the layer's new slots in a second
                                                       buffer (ExpertSlots.stage) while step n's forward, and
                                                       the engine's sampling after it, run on the live slots
    step n + 1  {"commit": {layer: phy2log row [P]}}   before the forward: wait for that staging (normally
                                                       long done), then ExpertSlots.switch makes the buffer
                                                       and the routing tables live together

So a layer routes by its new placement only once all of its weights are in place, every rank switches
the same layers at the same step (a token's rank and the rank computing its replica agree), and a step
waits at most for the layers staged with the step before it, never for the whole model. A commit for a
layer this worker did not stage (a group restarted in between, or the balancer's in-step baseline,
OnlineBalancer(staged=False)) falls back to ExpertSlots.migrate: the copy inside the step.
Cost: a second buffer of one layer's P / ep slots per layer staged at once. A switch retires the layer's
old buffer, and the next staging writes into it, so after the first rebalance nothing is allocated.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.parallel.eplb.online import ExpertSlots, StagedLayer, same_slots


class SlotMigrator:
    """The staged migrations of one worker's {MoE layer position: ExpertSlots} (this pipeline stage's layers).

    apply(update) at the start of each step, before its forward -> the bytes copied for the layers switched
    in it. executor: where staging runs (default one side thread).
    """

    def __init__(self, slots: dict[int, ExpertSlots], executor: Executor | None = None):
        self.slots = slots
        if executor is None:  # the side thread takes the rank's torch thread count (one per rank when serving)
            executor = ThreadPoolExecutor(1, thread_name_prefix="eplb-stage", initializer=torch.set_num_threads,
                                          initargs=(torch.get_num_threads(),))
        self.executor = executor
        self.in_flight: dict[int, tuple[list[int], Future]] = {}  # layer -> (its staged row, the staging)
        self.spares: list[LatentExperts] = []  # buffers retired by switches, for the next stagings

    def apply(self, update: dict) -> int:
        """update: the header's "eplb" part, {} or {"commit": {layer: row}, "stage": {layer: row}}; layers
        this worker does not hold are skipped. Switches first (a layer may be staged again right after)."""
        moved = 0
        for layer, row in update.get("commit", {}).items():
            if layer not in self.slots:
                continue
            staged_row, staging = self.in_flight.pop(layer, (None, None))
            if staged_row == row:
                staged = staging.result()  # waits for the weights; re-raises a failure
                self.spares.append(self.slots[layer].switch(staged))
                moved += staged.moved
            else:
                if staging is not None:
                    staging.result()  # a stale staging still reads the live slots: let it finish first
                moved += self.slots[layer].migrate(torch.tensor(row))
        for layer, row in update.get("stage", {}).items():
            if layer in self.slots:
                into = self._spare_for(self.slots[layer].experts)
                self.in_flight[layer] = (row, self.executor.submit(self._stage, layer, row, into))
        return moved

    def _spare_for(self, live: LatentExperts) -> LatentExperts | None:
        """A retired buffer of live's shapes and dtype, taken off the list; None: the staging allocates one."""
        for i, spare in enumerate(self.spares):
            if same_slots(spare, live):
                return self.spares.pop(i)
        return None

    def _stage(self, layer: int, row: list[int], into: LatentExperts | None) -> StagedLayer:
        return self.slots[layer].stage(torch.tensor(row), into)

    def close(self) -> None:
        """Stop the side thread (stagings not yet started are dropped)."""
        self.executor.shutdown(wait=True, cancel_futures=True)
