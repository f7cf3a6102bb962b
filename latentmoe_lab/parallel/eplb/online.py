"""EPLB while running on the hand-written EP workers: redundant expert slots and their online migration
(docs/design.md §14); the replica choice they dispatch with is replicas.py's, shared with native/.

Worker side, one MoE layer on one rank:
  ExpertSlots           the rank's P / ep slots (a LatentExperts of that many experts) and a host copy of
                        all E experts at the rank's TP width, from which `migrate` copies a new placement's
                        weights into the slots that change (the slots never move or resize)
  ReplicatedDispatcher  the All-to-All dispatcher over physical slots: each (token, logical expert) pair is
                        sent to one replica (`choose_replicas`), then everything works as without replicas
Engine side:
  OnlineBalancer        every rebalance_interval_steps steps, rebalance_experts on the recorder's window; the
                        layers whose placement changed are handed to the workers layers_per_step at a time
                        with the next steps, so the service never stops for a full reshuffle

Replicas are exact copies, so the expert sum of a token is the same whichever replica computes it.
"""
from __future__ import annotations

import torch

from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.eplb.rebalance import check_replica_count, rebalance_experts
from latentmoe_lab.parallel.eplb.replicas import choose_replicas, slot_tables
from latentmoe_lab.parallel.expert import AllToAllDispatcher
from latentmoe_lab.parallel.tensor import shard_experts


class ExpertSlots:
    """This rank's slots of one MoE layer. `experts` [P/ep experts] is what the layer computes with;
    log2phy [E, R+1] and logcnt [E] are updated in place, so the dispatcher holding them sees a migration."""

    def __init__(self, experts: LatentExperts, phy2log: torch.Tensor, rank: int, ep: int, tp_index: int, tp: int):
        num_experts, num_slots = experts.w13.shape[0], phy2log.shape[0]
        self.host = shard_experts(experts, 0, num_experts, tp_index, tp)  # every expert at this rank's width
        self.slots_per_rank = num_slots // ep
        self.first_slot = rank * self.slots_per_rank
        self.phy2log = phy2log.clone()
        self.log2phy, self.logcnt = slot_tables(self.phy2log, num_experts, num_slots - num_experts + 1)
        mine = self.phy2log[self.first_slot:self.first_slot + self.slots_per_rank]
        self.experts = _gather(self.host, mine)

    def migrate(self, phy2log: torch.Tensor) -> int:
        """Adopt a new placement [P] of this layer; copy the weights of this rank's changed slots from the
        host copy. Returns the bytes copied."""
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
        self.phy2log.copy_(phy2log)
        log2phy, logcnt = slot_tables(self.phy2log, len(self.logcnt), self.log2phy.shape[1])
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(logcnt)
        return moved


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

    placement [L, P] is what the workers hold (after the updates handed out so far). `updates(window, step)`
    -> {MoE layer position: phy2log row [P] list} to send with this step.
    """

    def __init__(self, num_layers: int, num_experts: int, ep: int, num_redundant: int, num_groups: int,
                 interval_steps: int, layers_per_step: int):
        check_redundant_experts(num_experts, ep, num_redundant)
        self.num_experts, self.num_slots = num_experts, num_experts + num_redundant
        self.ep, self.num_groups = ep, num_groups
        self.interval_steps, self.layers_per_step = interval_steps, layers_per_step
        # before any traffic: every expert equally loaded (the redundant slots go to the first experts)
        self.placement = self._balance(torch.ones(num_layers, num_experts))
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.rebalances = 0
        self.slots_moved = 0  # slots handed a different expert so far: the planned copies
        self._due = False

    def _balance(self, window: torch.Tensor) -> torch.Tensor:
        return rebalance_experts(window, self.num_slots, self.num_groups, 1, self.ep, refine=True)[0]

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(phy2log [L, P], logcnt [L, E]) of what the workers hold."""
        return self.placement, torch.stack([torch.bincount(row, minlength=self.num_experts) for row in self.placement])

    def rebalance_next_step(self) -> None:
        """Rebalance at the next step whatever the interval (an operator's or a benchmark's trigger)."""
        self._due = True

    def updates(self, window: torch.Tensor, step: int) -> dict[int, list[int]]:
        if (self._due or (step > 0 and step % self.interval_steps == 0)) and not self.pending:
            self._due = False
            target = self._balance(window)
            self.pending = [(layer, target[layer]) for layer in range(len(target))
                            if not torch.equal(target[layer], self.placement[layer])]
            self.rebalances += 1
        now, self.pending = self.pending[:self.layers_per_step], self.pending[self.layers_per_step:]
        for layer, row in now:
            self.slots_moved += int((self.placement[layer] != row).sum())
            self.placement[layer] = row
        return {layer: row.tolist() for layer, row in now}
