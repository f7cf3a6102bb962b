"""Expert parallelism with autograd: an All-to-All dispatcher whose backward is the reverse All-to-All.

Rank r of the "ep" mesh dim holds experts [r*E/R, (r+1)*E/R), stored as Shard(0) DTensors of the
global [E, ...] stacks (so checkpoints and FSDP2 see the whole expert set); under an EPLB placement it
holds slots [r*P/R, (r+1)*P/R) of [P, ...] stacks in slot order instead, and a pair goes to the slot
choose_replicas picks (native/eplb.py). Per MoE layer and rank,
N local tokens, top-K, latent size l:

  dispatch  counts  all_to_all [R] int64       (pairs this rank sends to each rank)
            rows    all_to_all [N*K, l]        one row per (token, expert) pair, grouped by destination
            ids     all_to_all [N*K] int32     each row's local expert id
  experts   the receiver sorts its rows expert-major and runs its experts (LatentExperts, unchanged)
  combine   rows    all_to_all [N*K, l]        the expert outputs, back to their tokens' ranks,
            where the routing weights are applied: the weights never travel, and their gradient
            (the router's) is computed on the token's own rank.
Backward: the gradients of the two row All-to-Alls travel the reverse way with the same counts.

Unlike parallel/expert.py (the hand-written, forward-only twin, which sends a token once per
destination rank and ships its weights), a token travels once per selected expert: simpler to
differentiate, K/(distinct ranks) times the bytes. `traffic.expert_pairs` counts both ways.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.native.eplb import moe_rows
from latentmoe_lab.native.local_params import LocalParams
from latentmoe_lab.native.stage import named_blocks
from latentmoe_lab.parallel.eplb.replicas import choose_replicas, slot_tables


class AllToAll(torch.autograd.Function):
    """rows [sum(send_counts), ...] -> [sum(recv_counts), ...]; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return _all_to_all(rows, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv_counts, ctx.send_counts, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = rows.new_empty(sum(recv_counts), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


class NativeDispatcher:
    """layers.moe.Dispatcher over the "ep" mesh dim, differentiable in the tokens and the routing weights."""

    def __init__(self, ep_mesh, num_experts: int, phy2log: torch.Tensor | None = None):
        """phy2log [P]: the layer's EPLB placement (native/eplb.py); None: expert e in slot e."""
        self.group = ep_mesh.get_group()
        self.ep, self.rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.phy2log = phy2log
        num_slots = num_experts if phy2log is None else len(phy2log)
        self.local_experts = num_slots // self.ep  # slots per rank
        if phy2log is not None:
            self.log2phy, self.logcnt = slot_tables(phy2log, num_experts, num_slots - num_experts + 1)

    def slots_of(self, indices: torch.Tensor) -> torch.Tensor:
        """indices [N, K] logical experts -> [N, K] the physical slot each pair goes to (itself without a placement)."""
        if self.phy2log is None:
            return indices
        log2phy, logcnt = self.log2phy.to(indices.device), self.logcnt.to(indices.device)
        return choose_replicas(indices, log2phy, logcnt, self.rank, self.local_experts)

    def dispatch(self, z: torch.Tensor, indices: torch.Tensor):
        """z [N, l], indices [N, K] global expert ids -> (z_perm [P, l] expert-major, counts [E_local], ctx)."""
        num_tokens, top_k = indices.shape
        flat = self.slots_of(indices).reshape(-1)  # pair p is token p // K, choice p % K
        dest = flat // self.local_experts
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        send_counts = torch.bincount(dest, minlength=self.ep)
        recv_counts = _all_to_all(send_counts, [1] * self.ep, [1] * self.ep, self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = AllToAll.apply(z[order // top_k], send, recv, self.group)
        ids = _all_to_all((flat[order] % self.local_experts).int(), send, recv, self.group).long()
        expert_order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=self.local_experts)
        return rows[expert_order], counts, (order, expert_order, send, recv, num_tokens, top_k)

    def combine(self, y_perm: torch.Tensor, weights: torch.Tensor, ctx) -> torch.Tensor:
        """y_perm [P, l] expert-major, weights [N, K] -> the weighted expert sum [N, l] fp32 of each local token."""
        order, expert_order, send, recv, num_tokens, top_k = ctx
        received_order = torch.zeros_like(y_perm).index_copy(0, expert_order, y_perm)
        back = AllToAll.apply(received_order, recv, send, self.group)  # [N*K, l] in `order`
        pairs = torch.zeros_like(back).index_copy(0, order, back)
        return (pairs.float().view(num_tokens, top_k, -1) * weights.float()[..., None]).sum(1)


def apply_expert_parallel(model, ep_mesh, placement: torch.Tensor | None = None) -> None:
    """Split every MoE layer's experts over `ep_mesh` and swap in the All-to-All dispatcher (in place).

    placement [MoE layers, P] (native/eplb.py): the layers' stacks become P slots in slot order (still on
    the meta device: nothing is allocated yet) and the dispatchers send each pair to a replica.
    """
    plan = {}
    rows = moe_rows(model.config)
    for i, block in named_blocks(model):
        if isinstance(block.ffn, LatentMoE):
            phy2log = None if placement is None else placement[rows[i]].clone()
            if phy2log is not None and len(phy2log) != block.ffn.num_experts:
                block.ffn.experts = _slot_stack(block.ffn.experts, len(phy2log))
            plan[f"layers.{i}.ffn.experts"] = LocalParams({"w13": Shard(0), "w2": Shard(0)})
            block.ffn.dispatcher = NativeDispatcher(ep_mesh, block.ffn.num_experts, phy2log)
    parallelize_module(model, ep_mesh, plan)


def _slot_stack(experts: LatentExperts, num_slots: int) -> LatentExperts:
    """An empty LatentExperts of num_slots experts, shaped, typed and placed (meta) like `experts`."""
    latent, inter = experts.w2.shape[2], experts.w2.shape[1]
    with torch.device(experts.w13.device):
        slots = LatentExperts(num_slots, latent, inter, experts.activation_clamp, experts.situ_betas)
    return slots.to(experts.w13.dtype)
