"""EPLB while running on the hand-written EP workers: redundant expert slots and their online migration
(docs/design.md §14); the replica choice they dispatch with is replicas.py's, shared with native/.

Worker side, one MoE layer on one rank:
  ExpertSlots           the rank's P / ep slots (a LatentExperts of that many experts) and a host copy of
                        all E experts at the rank's TP width. A new placement's weights are first `stage`d
                        into a second buffer beside the live slots (the changed slots from the host copy),
                        then `switch` makes buffer and routing tables live at once; `migrate` is the plain
                        twin that copies into the live slots in place
  ReplicatedDispatcher  the All-to-All dispatcher over physical slots: each (token, logical expert) pair is
                        sent to one replica (`choose_replicas`), then everything works as without replicas
  (migration.py's SlotMigrator runs the staging on a side thread and the switches at the steps' starts)
Engine side:
  OnlineBalancer        every rebalance_interval_steps steps, rebalance_experts on the recorder's window; the
                        layers whose placement changed are staged by the workers layers_per_step at a time
                        with the next steps and switched one step after, so no step waits for the whole model

Replicas are exact copies, so the expert sum of a token is the same whichever replica computes it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.eplb.rebalance import check_replica_count, rebalance_experts
from latentmoe_lab.parallel.eplb.replicas import check_placement, choose_replicas, slot_tables
from latentmoe_lab.parallel.expert import AllToAllDispatcher
from latentmoe_lab.parallel.tensor import shard_experts


@dataclass
class StagedLayer:
    """One layer's next placement with all of its weights in place, built beside the live slots.

    phy2log [P] the new placement; source [P] the placement it was staged from (a switch checks it is still
    the live one); experts [P/ep experts] the rank's slots under phy2log; moved: bytes copied from the host
    copy into the changed slots (the planned copies; the unchanged slots are copied from the live buffer)."""
    phy2log: torch.Tensor
    source: torch.Tensor
    experts: LatentExperts
    moved: int


class ExpertSlots:
    """This rank's slots of one MoE layer. `experts` [P/ep experts] is what the layer computes with;
    log2phy [E, R+1] and logcnt [E] are updated in place, so the dispatcher holding them sees a migration.
    `layer`: the LatentMoE computing with `experts` (replicate_layer sets it), which a switch repoints."""

    def __init__(self, experts: LatentExperts, phy2log: torch.Tensor, rank: int, ep: int, tp_index: int, tp: int):
        num_experts, num_slots = experts.w13.shape[0], phy2log.shape[0]
        self.host = shard_experts(experts, 0, num_experts, tp_index, tp)  # every expert at this rank's width
        self.slots_per_rank = num_slots // ep
        self.first_slot = rank * self.slots_per_rank
        self.phy2log = phy2log.clone()
        self.log2phy, self.logcnt = slot_tables(self.phy2log, num_experts, num_slots - num_experts + 1)
        mine = self.phy2log[self.first_slot:self.first_slot + self.slots_per_rank]
        self.experts = _gather(self.host, mine)
        self.layer: LatentMoE | None = None

    def _mine(self, phy2log: torch.Tensor) -> torch.Tensor:
        return phy2log[self.first_slot:self.first_slot + self.slots_per_rank]

    def stage(self, phy2log: torch.Tensor, into: LatentExperts | None = None) -> StagedLayer:
        """This rank's slots under placement phy2log [P] in a second buffer: `into` (a retired buffer of the
        same shape, reused: no allocation on the way) or a new one. Row by row, the unchanged slots copied from
        the live ones, the changed ones from the host copy (no temporaries). Only reads what the layer computes
        with, so it may run on a side thread while the forward runs."""
        live = self.experts
        if into is None:
            into = copy.deepcopy(live)
        elif into is live or not same_slots(into, live):
            raise ValueError("into: must be a buffer other than the live one, of its shapes and dtype")
        source = self.phy2log.clone()
        moved = 0
        with torch.no_grad():
            for local, (expert, before) in enumerate(zip(self._mine(phy2log).tolist(), self._mine(source).tolist())):
                for name in ("w13", "w2"):
                    row = getattr(into, name)[local]
                    row.copy_(getattr(live, name)[local] if expert == before else getattr(self.host, name)[expert])
                    moved += 0 if expert == before else row.numel() * row.element_size()
        return StagedLayer(phy2log.clone(), source, into, moved)

    def switch(self, staged: StagedLayer) -> LatentExperts:
        """Make a staged placement live: the layer computes with its buffer and the tables route by it, both
        set here between two forwards (the staged buffer is complete: stage returns only once it is).
        Returns the retired buffer (for the next stage's `into`). ValueError if the live placement changed
        since the staging."""
        if not torch.equal(staged.source, self.phy2log):
            raise ValueError("staged: was built from another placement than the live one; stage it again")
        retired, self.experts = self.experts, staged.experts
        if self.layer is not None:
            self.layer.experts = staged.experts
        self._adopt(staged.phy2log)
        return retired

    def migrate(self, phy2log: torch.Tensor) -> int:
        """The plain twin of stage + switch: adopt a new placement [P] of this layer, copying the weights of
        this rank's changed slots from the host copy into the live slots. Returns the bytes copied."""
        moved = 0
        with torch.no_grad():
            for local in range(self.slots_per_rank):
                slot = self.first_slot + local
                expert = int(phy2log[slot])
                if expert != int(self.phy2log[slot]):
                    for name in ("w13", "w2"):
                        target = getattr(self.experts, name)[local]
                        target.copy_(getattr(self.host, name)[expert])
                        moved += target.numel() * target.element_size()
        self._adopt(phy2log)
        return moved

    def _adopt(self, phy2log: torch.Tensor) -> None:
        """The tables of placement phy2log [P], in place (the dispatcher holds them)."""
        self.phy2log.copy_(phy2log)
        log2phy, logcnt = slot_tables(self.phy2log, len(self.logcnt), self.log2phy.shape[1])
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(logcnt)


def same_slots(a: LatentExperts, b: LatentExperts) -> bool:
    """Whether two expert buffers have the same shapes and dtype (one can stand in for the other)."""
    return all(getattr(a, n).shape == getattr(b, n).shape and getattr(a, n).dtype == getattr(b, n).dtype
               for n in ("w13", "w2"))


def _gather(host: LatentExperts, experts: torch.Tensor) -> LatentExperts:
    """A LatentExperts holding copies of host's `experts` [n] in that order."""
    out = LatentExperts(len(experts), host.w13.shape[1], host.w2.shape[1], host.activation_clamp, host.situ_betas)
    with torch.no_grad():
        out.w13.copy_(host.w13[experts])
        out.w2.copy_(host.w2[experts])
    return out.to(host.w13.dtype)


class ReplicatedDispatcher(AllToAllDispatcher):
    """AllToAllDispatcher over the P physical slots: logical ids become slot ids (choose_replicas) first."""

    def __init__(self, comm: Comm, slots: ExpertSlots):
        super().__init__(comm, len(slots.phy2log))
        self.slots = slots

    def dispatch_async(self, z: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None = None):
        physical = choose_replicas(indices, self.slots.log2phy, self.slots.logcnt, self.ep_index, self.local_experts)
        return super().dispatch_async(z, physical, weights)


def replicate_layer(layer: LatentMoE, placement: torch.Tensor, comm: Comm) -> tuple[ExpertSlots, ReplicatedDispatcher]:
    """Give `layer` this rank's slots of its placement row [P] (in place: layer.experts) -> (slots, dispatcher)."""
    mesh = comm.mesh
    slots = ExpertSlots(layer.experts, placement, mesh.index("ep"), mesh.pconfig.ep, mesh.index("tp"),
                        mesh.pconfig.tp)
    layer.experts = slots.experts
    slots.layer = layer
    return slots, ReplicatedDispatcher(comm, slots)


def check_redundant_experts(num_experts: int, ep: int, num_redundant: int) -> None:
    """eplb.num_redundant_experts against the model and the EP size (also the service file's check, before any
    model is built): the slots must split evenly over the ranks and stay within check_replica_count."""
    if (num_experts + num_redundant) % ep:
        raise ValueError(f"eplb.num_redundant_experts: moe.num_experts ({num_experts}) + it must divide by "
                         f"parallel.expert_parallel_size ({ep}), got {num_redundant}")
    check_replica_count(num_experts, num_experts + num_redundant, ep, "eplb.num_redundant_experts")


class OnlineBalancer:
    """The engine's side of online EPLB for `num_layers` MoE layers of E experts on ep ranks.

    placement [L, P] is what the workers compute with (every switch handed out so far). `updates(window, step)`
    -> the EPLB part of this step's header, {} or {"commit": {layer: row}, "stage": {layer: row}} (MoE layer
    position -> phy2log row [P] list): the workers switch the layers staged with the previous step at this
    step's start and start staging the next layers_per_step changed layers (migration.py).
    staged=False hands each layer as a commit alone, which the workers copy inside that step (the in-step
    baseline a benchmark compares with).
    """

    def __init__(self, num_layers: int, num_experts: int, ep: int, num_redundant: int, num_groups: int,
                 interval_steps: int, layers_per_step: int, staged: bool = True):
        check_redundant_experts(num_experts, ep, num_redundant)
        self.num_experts, self.num_slots = num_experts, num_experts + num_redundant
        self.ep, self.num_groups = ep, num_groups
        self.interval_steps, self.layers_per_step = interval_steps, layers_per_step
        self.staged = staged
        # before any traffic: every expert equally loaded (the redundant slots go to the first experts)
        self.placement = self._balance(torch.ones(num_layers, num_experts))
        self.pending: list[tuple[int, torch.Tensor]] = []  # changed layers not yet handed out
        self.in_flight: dict[int, torch.Tensor] = {}  # staged with the last step, switched with the next
        self.rebalances = 0
        self.slots_moved = 0  # slots switched to a different expert so far: the planned copies
        self._due = False
        self._target: torch.Tensor | None = None  # rebalance_next_step's placement

    def _balance(self, window: torch.Tensor) -> torch.Tensor:
        return rebalance_experts(window, self.num_slots, self.num_groups, 1, self.ep, refine=True)[0]

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(phy2log [L, P], logcnt [L, E]) of what the workers compute with."""
        return self.placement, torch.stack([torch.bincount(row, minlength=self.num_experts) for row in self.placement])

    def rebalance_next_step(self, placement: torch.Tensor | None = None) -> None:
        """Rebalance at the next step whatever the interval (an operator's or a benchmark's trigger), once no
        layer of the last rebalance is still pending. placement [L, P] int64: migrate to it instead of the
        balancer's answer for the window."""
        if placement is not None:
            check_placement(placement, len(self.placement), self.num_experts, self.ep)
            if placement.shape[1] != self.num_slots:
                raise ValueError(f"placement: expected {self.num_slots} slots per layer, got {placement.shape[1]}")
        self._due, self._target = True, None if placement is None else placement.clone()

    def migrating(self) -> bool:
        """Whether a triggered rebalance has yet to run or its layers are still pending or staged."""
        return bool(self._due or self.pending or self.in_flight)

    def updates(self, window: torch.Tensor, step: int) -> dict[str, dict[int, list[int]]]:
        commit, self.in_flight = self.in_flight, {}
        self._switch(commit)
        if (self._due or (step > 0 and step % self.interval_steps == 0)) and not self.pending:
            target = self._balance(window) if self._target is None else self._target  # vs this step's switches
            self._due, self._target = False, None
            self.pending = [(layer, target[layer]) for layer in range(len(target))
                            if not torch.equal(target[layer], self.placement[layer])]
            self.rebalances += 1
        now, self.pending = dict(self.pending[:self.layers_per_step]), self.pending[self.layers_per_step:]
        if self.staged:
            self.in_flight = now
        else:  # switched at once, copied inside this step
            self._switch(now)
            commit, now = commit | now, {}
        if not (commit or now):
            return {}
        return {"commit": {layer: row.tolist() for layer, row in commit.items()},
                "stage": {layer: row.tolist() for layer, row in now.items()}}

    def _switch(self, rows: dict[int, torch.Tensor]) -> None:
        for layer, row in rows.items():
            self.slots_moved += int((self.placement[layer] != row).sum())
            self.placement[layer] = row
