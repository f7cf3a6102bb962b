"""Expert-parallel load balancer: redundant expert slots and a balanced placement (docs/design.md §14).

    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks)

weight [L, E] is the load each logical expert carried in each MoE layer (tokens routed to it over a
window). The layer gets num_replicas = E + R physical slots, num_replicas / num_ranks per rank; rank r
holds slots [r * P/N, (r + 1) * P/N). The answer, per layer:

    phy2log [L, P]       int64  the logical expert whose weights sit in each physical slot
    log2phy [L, E, R+1]  int64  the physical slots of each logical expert, -1 padded
    logcnt  [L, E]       int64  how many replicas each logical expert has (>= 1, sums to P)

Two building blocks, both greedy:
- replicate: start from one replica per expert and hand each extra slot to the expert whose load per
  replica (weight / count) is currently the largest;
- pack: sort items by weight, heaviest first, and put each on the lightest pack that still has a free
  place (every pack ends up with the same number of items).

Hierarchical policy (num_groups % num_nodes == 0): pack the expert groups onto nodes, so that the
experts of one group (which group-limited routing sends a token to together) share a node; replicate
inside each node with the node's share of the slots; pack each node's replicas onto its ranks. Otherwise
the global policy: the same steps with one group and one node, i.e. replicate over all slots and pack
them onto all ranks. The loops run over items and slots; every step is vectorised over layers.

refine=True (refine_replication) adds a packing-aware check after the replication: a few replica counts
aimed at the mean rank load are packed like the real ones and replace the greedy counts of a row only
when its busiest rank gets lighter (the greedy minimises the load per replica, not per rank).
"""
from __future__ import annotations

import torch


# One layer's slots at most: the greedy steps loop over slots in Python (about 0.35 ms a slot on a CPU,
# 10**5 slots took 50 s), so a slot count from a typo must be refused, not run. k3-2.8t's 896 experts fit.
MAX_SLOTS_PER_LAYER = 8192


def check_replica_count(num_experts: int, num_replicas: int, num_ranks: int, name: str = "num_replicas") -> None:
    """ValueError naming `name` when num_replicas slots per layer are more than any placement can use: one
    replica of every expert on every rank (a second copy on the same rank takes no load off it), and at
    most MAX_SLOTS_PER_LAYER."""
    limit = max(num_experts, min(num_experts * num_ranks, MAX_SLOTS_PER_LAYER))
    if num_replicas > limit:
        raise ValueError(f"{name}: {num_replicas} expert slots per layer, more than {limit} (at most one replica "
                         f"of each of the {num_experts} experts on each of {num_ranks} ranks, and at most "
                         f"{MAX_SLOTS_PER_LAYER} slots)")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return value


def check_rebalance_args(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                         num_ranks: int) -> None:
    """ValueError naming the argument when the placement cannot be built."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a non-empty 2-D tensor [layers, experts], got {shape}")
    if weight.is_complex() or not torch.isfinite(weight).all() or (weight < 0).any():  # in its own dtype: 1e300
        raise ValueError("weight: loads must be finite and >= 0")
    num_experts = weight.shape[1]
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_ranks", num_ranks)):
        _positive_int(name, value)
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas: must be >= the number of experts ({num_experts}), got {num_replicas}")
    if num_replicas % num_ranks:
        raise ValueError(f"num_replicas: must divide evenly over num_ranks={num_ranks}, got {num_replicas}")
    check_replica_count(num_experts, num_replicas, num_ranks)
    if num_experts % num_groups:
        raise ValueError(f"num_groups: must divide the number of experts ({num_experts}), got {num_groups}")
    if num_ranks % num_nodes:
        raise ValueError(f"num_nodes: must divide num_ranks={num_ranks}, got {num_nodes}")


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [L, n] -> (pack [L, n], place [L, n]): heaviest item first onto the lightest non-full pack
    (ties to the lower pack index); each of the num_packs packs takes n / num_packs items."""
    layers, items = weight.shape
    capacity = items // num_packs
    pack = torch.empty(layers, items, dtype=torch.int64)
    place = torch.empty(layers, items, dtype=torch.int64)
    order = weight.sort(dim=-1, descending=True, stable=True).indices
    pack_load = torch.zeros(layers, num_packs, dtype=torch.float64)
    pack_fill = torch.zeros(layers, num_packs, dtype=torch.int64)
    rows = torch.arange(layers)
    for j in range(items):
        item = order[:, j]
        open_load = pack_load.masked_fill(pack_fill >= capacity, float("inf"))
        chosen = open_load.argmin(dim=-1)  # the first minimum: ties go to the lower pack
        pack[rows, item] = chosen
        place[rows, item] = pack_fill[rows, chosen]
        pack_load[rows, chosen] += weight[rows, item]
        pack_fill[rows, chosen] += 1
    return pack, place


def replicate_experts(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, n] -> (slot2item [L, num_slots], replica index of each slot [L, num_slots], count [L, n]).
    Slot i < n holds item i; each later slot goes to the item with the largest weight / count."""
    layers, items = weight.shape
    rows = torch.arange(layers)
    slot2item = torch.arange(num_slots).repeat(layers, 1)
    replica = torch.zeros(layers, num_slots, dtype=torch.int64)
    count = torch.ones(layers, items, dtype=torch.int64)
    for slot in range(items, num_slots):
        item = (weight / count).argmax(dim=-1)
        slot2item[:, slot] = item
        replica[:, slot] = count[rows, item]
        count[rows, item] += 1
    return slot2item, replica, count


def _slots_of(count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """count [L, n] (each row summing to the same P) -> (slot2item [L, P], replica index [L, P]): the
    replicas laid out item by item, item 0's first."""
    ends = count.cumsum(-1)
    slots = torch.arange(int(ends[0, -1])).expand(count.shape[0], -1).contiguous()
    slot2item = torch.searchsorted(ends, slots, right=True)
    return slot2item, slots - (ends - count).gather(-1, slot2item)


def packed_max_load(weight: torch.Tensor, slot2item: torch.Tensor, count: torch.Tensor,
                    num_packs: int) -> torch.Tensor:
    """weight [L, n], slot2item [L, P], count [L, n] -> [L]: the heaviest pack's load after balanced_packing
    of the slots (each carrying weight / count; the slot order breaks ties, as in the real packing)."""
    slot_load = (weight / count).gather(-1, slot2item)
    pack, _ = balanced_packing(slot_load, num_packs)
    return torch.zeros(weight.shape[0], num_packs, dtype=slot_load.dtype).scatter_add_(1, pack, slot_load).amax(-1)


def _target_counts(weight: torch.Tensor, num_slots: int, target: torch.Tensor) -> torch.Tensor:
    """weight [L, n], target [L, 1] -> count [L, n]: ceil(weight / target) replicas (at least 1, so no
    replica carries more than the target); the slots left over go one at a time to the heaviest expert
    that still has a single replica (splitting it, not re-splitting one already at the target). Rows
    needing more than num_slots replicas get count 0 (no candidate)."""
    count = (weight / target * (1 - 1e-9)).ceil().clamp(min=1).nan_to_num(1).long()
    left = num_slots - count.sum(-1)
    rows = torch.arange(weight.shape[0])
    bonus = weight.amax(-1, keepdim=True) + 1  # any single-replica expert before every split one
    for _ in range(int(left.clamp(min=0).max())):
        item = (weight / count + bonus * (count == 1)).argmax(-1)
        count[rows, item] += (left > 0).long()
        left = left - (left > 0).long()
    return count.masked_fill((left < 0)[:, None], 0)


def refine_replication(weight: torch.Tensor, slot2item: torch.Tensor, replica: torch.Tensor, count: torch.Tensor,
                       num_packs: int, splits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packing-aware replica counts (docs/design.md §14). weight [L, n] and replicate_experts' answer
    (slot2item [L, P], replica [L, P], count [L, n]) -> the same three, per row either unchanged or
    replaced by a candidate whose packed busiest pack is strictly lighter.

    The greedy replication minimises the largest load per replica, but the busiest rank is what counts:
    16 equally hot experts on 64 ranks with 16 spare slots get 5 replicas each, 80 hot replicas, and
    16 ranks hold two. The candidates instead aim every replica at a load of mean_rank_load / k
    (k = 1 .. splits), so that the hot replicas tile the ranks one (or k) per rank."""
    num_slots = slot2item.shape[1]
    best = packed_max_load(weight, slot2item, count, num_packs)
    mean_rank_load = weight.sum(-1, keepdim=True) / num_packs
    for k in range(1, splits + 1):
        candidate = _target_counts(weight, num_slots, mean_rank_load / k)
        valid = (candidate > 0).all(-1)
        candidate = torch.where(valid[:, None], candidate, count)
        new_slot2item, new_replica = _slots_of(candidate)
        load = packed_max_load(weight, new_slot2item, candidate, num_packs)
        better = valid & (load < best * (1 - 1e-12))
        if better.any():
            slot2item = torch.where(better[:, None], new_slot2item, slot2item)
            replica = torch.where(better[:, None], new_replica, replica)
            count = torch.where(better[:, None], candidate, count)
            best = torch.where(better, load, best)
    return slot2item, replica, count


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations [L, n]."""
    inverse = torch.empty_like(permutation)
    inverse.scatter_(1, permutation, torch.arange(permutation.shape[1]).expand_as(permutation))
    return inverse


def _hierarchical(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                  num_ranks: int, refine: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (phy2log [L, P], replica index of each slot [L, P], logcnt [L, E])."""
    layers, num_experts = weight.shape
    group_size, groups_per_node = num_experts // num_groups, num_groups // num_nodes
    experts_per_node, slots_per_node = num_experts // num_nodes, num_replicas // num_nodes
    slots_per_rank = num_replicas // num_ranks

    # 1. groups onto nodes. Renumber the experts node-major ("node-local" ids): node n owns the
    #    contiguous range [n * E/nodes, (n + 1) * E/nodes), its groups in packing order.
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, G]
    group_node, group_place = balanced_packing(group_load, num_nodes)
    first_id = (group_node * groups_per_node + group_place) * group_size  # [L, G]
    log2local = (first_id[:, :, None] + torch.arange(group_size)).flatten(1)  # [L, E]
    local2log = _inverse(log2local)

    # 2. replicas within each node: every node is a row of its own here.
    local_load = weight.gather(-1, local2log).reshape(layers * num_nodes, experts_per_node)
    slot2local, slot_replica, local_count = replicate_experts(local_load, slots_per_node)
    if refine:
        slot2local, slot_replica, local_count = refine_replication(local_load, slot2local, slot_replica,
                                                                   local_count, num_ranks // num_nodes)

    # 3. each node's slots onto its ranks, by load per replica.
    slot_load = (local_load / local_count).gather(-1, slot2local)
    rank, place = balanced_packing(slot_load, num_ranks // num_nodes)
    final2slot = _inverse(rank * slots_per_rank + place)  # final slot order inside the node -> packed slot
    final2local = slot2local.gather(-1, final2slot)
    node_offset = (torch.arange(num_nodes) * experts_per_node).repeat(layers)[:, None]
    final2local = (final2local + node_offset).reshape(layers, num_replicas)
    phy2log = local2log.gather(-1, final2local)
    replica = slot_replica.gather(-1, final2slot).reshape(layers, num_replicas)
    logcnt = local_count.reshape(layers, num_experts).gather(-1, log2local)
    return phy2log, replica, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int, refine: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, E] loads -> (phy2log [L, P], log2phy [L, E, P - E + 1] -1 padded, logcnt [L, E]), int64.

    Hierarchical policy when num_groups % num_nodes == 0, else global (module docstring). refine=False is
    the public balancer exactly; refine=True adds refine_replication after the replication step (never a
    busier rank, often a much lighter one when a few experts are equally hot).
    """
    if not isinstance(refine, bool):
        raise ValueError(f"refine: must be True or False, got {refine!r}")
    check_rebalance_args(weight, num_replicas, num_groups, num_nodes, num_ranks)
    weight = weight.detach().to("cpu", torch.float64)
    layers, num_experts = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, replica, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_ranks, refine)
    else:
        phy2log, replica, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_ranks, refine)
    max_replicas = num_replicas - num_experts + 1
    log2phy = torch.full((layers, num_experts * max_replicas), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * max_replicas + replica, torch.arange(num_replicas).expand(layers, -1))
    return phy2log, log2phy.view(layers, num_experts, max_replicas), logcnt


def default_placement(num_layers: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout without a balancer (parallel/expert.py): slot e holds expert e, one replica each."""
    phy2log = torch.arange(num_experts).repeat(num_layers, 1)
    return phy2log, phy2log[:, :, None].clone(), torch.ones(num_layers, num_experts, dtype=torch.int64)
