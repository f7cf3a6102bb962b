"""An EPLB placement on the native EP layout: experts in physical slots, checkpoints in logical order.

    native = build_native(config, NativeLayout(ep=2), mesh, checkpoint, placement=phy2log)   # [MoE layers, P]

phy2log is rebalance_experts' answer (parallel/eplb/rebalance.py, docs/design.md §14), the same tensor the hand-written
layout takes (parallel.sharded.parallelize(..., placement)). Without it, ep rank r holds experts
[r E/R, (r+1) E/R) and the expert stacks w13 / w2 are Shard(0) DTensors of the logical [E, ...] stacks.
With it, every MoE layer's stacks become [P, ...] in slot order (P = E + redundant slots), still Shard(0),
so rank r holds slots [r P/R, (r+1) P/R) and the experts they name; a token goes to the replica on its
own rank when there is one, else spread over the replicas (parallel/eplb/replicas.py's choose_replicas).

On disk the stacks stay logical [E, ...] (what save_pretrained, export and any other layout read), so a
checkpoint saved under one placement loads under another, or into one plain process. The mapping is
an All-to-All over ep (`move_rows`): to disk, each logical expert from its first replica; from disk,
each slot from its expert. No rank holds more than its ep block of a stack (under FSDP2 the dp_shard
pieces of that block are gathered for the move, and cut again after it).

Training: with a permutation (P = E) every slot's gradient is its expert's whole gradient. With replicas,
each replica's gradient covers the tokens sent to it, so after backward `sum_replica_gradients` gives every
replica the sum over its expert's replicas (`sum_rows` to the expert's owner, then `move_rows` back), AdamW
then moves the replicas alike, and the clipping norm counts each expert once (`unique_square`). Both work on
ep blocks, so under FSDP2 on the experts a rank gathers its block's dp_shard pieces for them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.native.stage import named_blocks
from latentmoe_lab.parallel.eplb.replicas import check_placement, choose_replicas, slot_tables

EXPERT_STACKS = ("w13", "w2")


def check_native_placement(placement: torch.Tensor, config: ModelConfig, ep: int) -> None:
    """ValueError naming `placement` unless it fits the model's MoE layers and experts over `ep` ranks."""
    if ep == 1:
        raise ValueError("placement: needs expert parallelism (ep > 1); with one ep rank every expert is local")
    check_placement(placement, sum(map(config.is_moe_layer, range(config.num_layers))), config.moe.num_experts, ep)


def moe_rows(config: ModelConfig) -> dict[int, int]:
    """{global layer index: its row in a placement [MoE layers, P]}."""
    moe = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    return {layer: row for row, layer in enumerate(moe)}


def placed_layers(module: nn.Module) -> dict[str, torch.Tensor]:
    """{"layers.i.ffn.experts": phy2log row [P]} of every MoE layer that holds slots of a placement."""
    placed = {}
    if not hasattr(module, "layers"):  # not a model or a pipeline stage of one: nothing placed
        return placed
    for i, block in named_blocks(module):
        if isinstance(block.ffn, LatentMoE):
            dispatcher = getattr(block.ffn.dispatcher, "inner", block.ffn.dispatcher)  # traffic's recorder wraps it
            phy2log = getattr(dispatcher, "phy2log", None)
            if phy2log is not None:
                placed[f"layers.{i}.ffn.experts"] = phy2log
    return placed


def pair_destinations(indices: torch.Tensor, num_experts: int, ep: int, phy2log: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """indices [R_ep, N, K] every ep rank's routing -> [R_ep, N, K] the ep rank each pair is sent to.

    phy2log [P]: the layer's EPLB placement (the replica expert.py's dispatcher picks); None: contiguous experts.
    """
    if phy2log is None:
        return indices // (num_experts // ep)
    log2phy, logcnt = slot_tables(phy2log, num_experts, len(phy2log) - num_experts + 1)
    per_rank = len(phy2log) // ep
    return torch.stack([choose_replicas(own, log2phy, logcnt, r, per_rank) // per_rank
                        for r, own in enumerate(indices)])


def pairs_per_rank(indices: torch.Tensor, num_experts: int, ep: int, phy2log: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """[ep] int64: the (token, expert) pairs each ep rank's experts compute in one dispatch (its load)."""
    return torch.bincount(pair_destinations(indices, num_experts, ep, phy2log).reshape(-1), minlength=ep)


def _stack_prefix(key: str, placed: dict[str, torch.Tensor]) -> str | None:
    """The placed "layers.i.ffn.experts" that `key` is a stack of (a parameter or its optimizer state), or None."""
    owner, _, rest = key.partition(".ffn.experts.")
    prefix = f"{owner}.ffn.experts"
    if prefix in placed and rest.split(".", 1)[0] in EXPERT_STACKS:
        return prefix
    return None


def _ep_placements(tensor: DTensor) -> list:
    """Shard(0) on the "ep" mesh dim, Replicate elsewhere: each ep rank's contiguous block of the stack."""
    return [Shard(0) if name == "ep" else Replicate() for name in tensor.device_mesh.mesh_dim_names]


def _ep_block(tensor: DTensor) -> torch.Tensor:
    """This rank's contiguous ep block of a stack (FSDP2's dp_shard pieces of it gathered)."""
    return tensor.redistribute(tensor.device_mesh, _ep_placements(tensor)).to_local()


def _ep_group(tensor: DTensor):
    mesh = tensor.device_mesh
    return mesh.get_group(mesh.mesh_dim_names.index("ep"))


def move_rows(block: torch.Tensor, source: torch.Tensor, num_in_rows: int, group) -> torch.Tensor:
    """Rows of a row-sharded stack to another row-sharded stack over `group` (R ranks, contiguous blocks).

    block [num_in_rows / R, ...]: this rank's block of the input stack; source [num_out_rows] int64: output
    row i is input row source[i]. Returns this rank's block [num_out_rows / R, ...] of the output stack.
    One All-to-All: rows go straight from the rank that holds them to the rank that needs them.
    """
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    source = source.to(torch.int64).cpu()
    in_per, out_per = num_in_rows // ranks, len(source) // ranks
    owner = source // in_per  # the rank holding each output row's input
    needer = torch.arange(len(source)) // out_per  # the rank holding each output row
    mine = (owner == me).nonzero().squeeze(-1)  # output rows this rank supplies, by destination (ascending)
    send_counts = torch.bincount(needer[mine], minlength=ranks).tolist()
    wanted = owner[me * out_per:(me + 1) * out_per]
    recv_counts = torch.bincount(wanted, minlength=ranks).tolist()
    rows = block[(source[mine] - me * in_per).to(block.device)]
    received = rows.new_empty(sum(recv_counts), *rows.shape[1:])  # grouped by sender, ascending within
    dist.all_to_all_single(received, rows.contiguous(), recv_counts, send_counts, group=group)
    out = torch.empty_like(received)
    out[torch.argsort(wanted, stable=True).to(block.device)] = received
    return out


def sum_rows(block: torch.Tensor, phy2log: torch.Tensor, num_experts: int, group) -> torch.Tensor:
    """The inverse direction of move_rows, summing: slots to experts.

    block [P / R, ...]: this rank's slots of a stack in slot order (phy2log [P]); returns this rank's block
    [E / R, ...] of the [E, ...] stack whose row e is the sum of the rows of every slot holding expert e.
    One All-to-All: each slot's row goes to the rank that owns its expert's row, which adds them up.
    """
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    phy2log = phy2log.to(torch.int64).cpu()
    per_slot, per_expert = len(phy2log) // ranks, num_experts // ranks
    owner = phy2log // per_expert  # the rank that sums each slot's row
    mine = owner[me * per_slot:(me + 1) * per_slot]
    send_counts = torch.bincount(mine, minlength=ranks).tolist()
    incoming = (owner == me).nonzero().squeeze(-1)  # slots whose rows come here, by sender (ascending)
    recv_counts = torch.bincount(incoming // per_slot, minlength=ranks).tolist()
    rows = block[torch.argsort(mine, stable=True).to(block.device)]
    received = rows.new_empty(sum(recv_counts), *rows.shape[1:])
    dist.all_to_all_single(received, rows.contiguous(), recv_counts, send_counts, group=group)
    out = received.new_zeros(per_expert, *rows.shape[1:])
    return out.index_add_(0, (phy2log[incoming] - me * per_expert).to(block.device), received)


def sum_replica_gradients(module: nn.Module) -> None:
    """Every replica's gradient becomes the sum over all replicas of its expert (the expert's whole gradient),
    so AdamW keeps the replicas identical. Works on each rank's ep block of a gradient (under FSDP2 its
    dp_shard pieces are gathered first, and each rank keeps its own piece of the result)."""
    num_experts = module.config.moe.num_experts
    for prefix, phy2log in placed_layers(module).items():
        if len(phy2log.unique()) == len(phy2log):
            continue  # a permutation: every gradient is already its expert's whole one
        experts = module.get_submodule(prefix)
        for name in EXPERT_STACKS:
            grad = getattr(experts, name).grad
            if grad is not None:
                group, mesh = _ep_group(grad), grad.device_mesh
                whole = sum_rows(_ep_block(grad), phy2log, num_experts, group)
                summed = DTensor.from_local(move_rows(whole, phy2log, num_experts, group), mesh,
                                            _ep_placements(grad), run_check=False, shape=grad.shape,
                                            stride=grad.stride())
                grad.to_local().copy_(summed.redistribute(mesh, grad.placements).to_local())


def unique_square(grad: DTensor, copies: torch.Tensor) -> torch.Tensor:
    """fp64 squared L2 norm of a replicated stack's gradient over all ranks, each expert counted once:
    copies [P / R] (replica_copies) divides each slot's square by its expert's replica count."""
    block = _ep_block(grad).double()
    square = (block.pow(2).flatten(1).sum(1) / copies.to(block.device)).sum()
    dist.all_reduce(square, group=_ep_group(grad))  # the ep blocks; equal over dp_shard, so not summed there
    return square


def replica_gradient_bytes(module: nn.Module, rank: int, ep: int) -> int:
    """Bytes ep rank `rank` sends to other ranks in one sum_replica_gradients: sum_rows, then move_rows back."""
    total = 0
    num_experts = module.config.moe.num_experts
    for prefix, phy2log in placed_layers(module).items():
        if len(phy2log.unique()) == len(phy2log):
            continue
        owner = phy2log // (num_experts // ep)  # the rank summing each slot's row
        holder = torch.arange(len(phy2log)) // (len(phy2log) // ep)  # the rank holding each slot
        rows = int(((holder == rank) & (owner != rank)).sum() + ((owner == rank) & (holder != rank)).sum())
        for name in EXPERT_STACKS:
            param = getattr(module.get_submodule(prefix), name)
            total += rows * math.prod(param.shape[1:]) * param.element_size()
    return total


def replica_copies(module: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """{expert stack with replicas: [P / R] float64, how many slots hold the expert of each of this rank's slots}:
    a global gradient norm divides each slot's square by it, so an expert counts once."""
    copies = {}
    for prefix, phy2log in placed_layers(module).items():
        counts = torch.bincount(phy2log)[phy2log].double()
        if counts.max() == 1:
            continue
        experts = module.get_submodule(prefix)
        for name in EXPERT_STACKS:
            param = getattr(experts, name)
            group = _ep_group(param)
            per_rank = len(phy2log) // dist.get_world_size(group)
            me = dist.get_rank(group)
            copies[param] = counts[me * per_rank:(me + 1) * per_rank]
    return copies


def first_replicas(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:
    """phy2log [P] -> [E] the first slot holding each expert."""
    slots = torch.arange(len(phy2log))
    first = torch.full((num_experts,), len(phy2log), dtype=torch.int64)
    return first.scatter_reduce(0, phy2log, slots, reduce="amin")


def to_logical(state: dict[str, torch.Tensor], placed: dict[str, torch.Tensor], num_experts: int) -> dict:
    """A state dict (model's or flattened optimizer's) with every placed stack [P, ...] in slot order replaced
    by the logical [E, ...] stack, ep-sharded in contiguous blocks (what the checkpoint files hold)."""
    out = dict(state)
    for key, tensor in state.items():
        prefix = _stack_prefix(key, placed)
        if prefix is None or not isinstance(tensor, DTensor) or tensor.dim() == 0:
            continue
        blocks = tensor.redistribute(tensor.device_mesh, _ep_placements(tensor))
        moved = move_rows(blocks.to_local(), first_replicas(placed[prefix], num_experts), tensor.shape[0],
                          _ep_group(tensor))
        out[key] = DTensor.from_local(moved, tensor.device_mesh, _ep_placements(tensor), run_check=False,
                                      shape=(num_experts, *tensor.shape[1:]), stride=_contiguous_stride(
                                          (num_experts, *tensor.shape[1:])))
    return out


def logical_targets(state: dict[str, torch.Tensor], placed: dict[str, torch.Tensor], num_experts: int) -> dict:
    """Empty logical [E, ...] stacks (ep-sharded blocks) for every placed stack of `state`, for a checkpoint read."""
    targets = {}
    for key, tensor in state.items():
        if _stack_prefix(key, placed) is not None and isinstance(tensor, DTensor) and tensor.dim() > 0:
            shape = (num_experts, *tensor.shape[1:])
            ranks = tensor.device_mesh.size(tensor.device_mesh.mesh_dim_names.index("ep"))
            local = tensor.to_local().new_empty(num_experts // ranks, *tensor.shape[1:])
            targets[key] = DTensor.from_local(local, tensor.device_mesh, _ep_placements(tensor), run_check=False,
                                              shape=shape, stride=_contiguous_stride(shape))
    return targets


def copy_to_slots(state: dict[str, torch.Tensor], logical: dict[str, DTensor], placed: dict[str, torch.Tensor]) -> None:
    """Fill each placed stack of `state` (in place, slot order, its own placements) from its logical stack."""
    for key, stack in logical.items():
        target = state[key]
        prefix = _stack_prefix(key, placed)
        moved = move_rows(stack.to_local(), placed[prefix], stack.shape[0], _ep_group(stack))
        slots = DTensor.from_local(moved, target.device_mesh, _ep_placements(target), run_check=False,
                                   shape=target.shape, stride=target.stride())
        target.to_local().copy_(slots.redistribute(target.device_mesh, target.placements).to_local())


def logical_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict tensor's global shape as stored on disk (placed stacks: [E, ...])."""
    placed = placed_layers(module)
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    if placed:
        num_experts = module.config.moe.num_experts
        shapes = {name: (num_experts, *shape[1:]) if _stack_prefix(name, placed) else shape
                  for name, shape in shapes.items()}
    return shapes


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()
