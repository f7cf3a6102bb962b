"""A placement's vocabulary, shared by every EP layout that holds replicas: the check of a placement, its
slot tables, and which replica a (token, logical expert) pair goes to (docs/design.md §14).

    phy2log [L, P]  the logical expert in each physical slot (rebalance_experts' answer, rebalance.py)
    log2phy, logcnt = slot_tables(phy2log[layer], E, max_replicas)   # [E, R+1] -1 padded, [E]
    physical = choose_replicas(indices [N, K], log2phy, logcnt, rank, slots_per_rank)   # [N, K] slots

The hand-written EP workers (online.py's ReplicatedDispatcher) and the native DeviceMesh layout
(native/eplb.py, native/expert.py) both route through choose_replicas, so a token goes to the same replica
in training and serving.
"""
from __future__ import annotations

import torch


def check_placement(placement: torch.Tensor, num_layers: int, num_experts: int, ep: int) -> None:
    """ValueError naming `placement` unless it is [num_layers, P] int64 with P divisible by ep and every
    expert in every layer at least once."""
    if not isinstance(placement, torch.Tensor) or placement.dim() != 2 or placement.shape[0] != num_layers \
            or placement.dtype != torch.int64 or placement.shape[1] % ep:
        shape = tuple(placement.shape) if isinstance(placement, torch.Tensor) else type(placement).__name__
        raise ValueError(f"placement: expected int64 [MoE layers={num_layers}, slots] with slots divisible by "
                         f"ep={ep}, got {shape}")
    if placement.min() < 0 or placement.max() >= num_experts or any(
            len(row.unique()) != num_experts for row in placement):
        raise ValueError(f"placement: every slot must hold an expert in [0, {num_experts}) and every expert "
                         f"a slot, in every layer")


def slot_tables(phy2log: torch.Tensor, num_experts: int, max_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's phy2log [P] -> (log2phy [E, max_replicas] -1 padded, slots in increasing order; logcnt [E])."""
    logcnt = torch.bincount(phy2log, minlength=num_experts)
    order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, increasing within an expert
    first = torch.cumsum(logcnt, 0) - logcnt
    replica = torch.arange(len(phy2log)) - first[phy2log[order]]
    log2phy = torch.full((num_experts, max_replicas), -1, dtype=torch.int64)
    log2phy[phy2log[order], replica] = order
    return log2phy, logcnt


def choose_replicas(indices: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, rank: int,
                    slots_per_rank: int) -> torch.Tensor:
    """indices [N, K] logical experts -> [N, K] physical slots: a replica on `rank` when the expert has one
    there, else replica (token % count), which spreads the tokens of a replicated expert evenly."""
    candidates = log2phy[indices]  # [N, K, R+1]
    on_rank = (candidates >= 0) & (candidates // slots_per_rank == rank)
    local = candidates.gather(-1, on_rank.int().argmax(-1, keepdim=True)).squeeze(-1)
    token = torch.arange(indices.shape[0], device=indices.device)[:, None]
    spread = candidates.gather(-1, (token % logcnt[indices]).unsqueeze(-1)).squeeze(-1)
    return torch.where(on_rank.any(-1), local, spread)


def choose_replicas_reference(indices: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, rank: int,
                              slots_per_rank: int) -> torch.Tensor:
    """Twin of choose_replicas, one pair at a time."""
    out = torch.empty_like(indices)
    for n, row in enumerate(indices.tolist()):
        for k, expert in enumerate(row):
            slots = [s for s in log2phy[expert].tolist() if s >= 0]
            local = [s for s in slots if s // slots_per_rank == rank]
            out[n, k] = local[0] if local else slots[n % len(slots)]
    return out
