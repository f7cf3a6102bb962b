"""Expert parallelism with autograd: an All-to-All dispatcher whose backward is the reverse All-to-All.

Rank r of the "ep" mesh dim holds experts [r*E/R, (r+1)*E/R), stored as Shard(0) DTensors of the
global [E, ...] stacks (so checkpoints and FSDP2 see the whole expert set). Per MoE layer and rank,
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

from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.native.stage import named_blocks
from latentmoe_lab.native.local_params import LocalParams


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

    def __init__(self, ep_mesh, num_experts: int):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep

    def dispatch(self, z: torch.Tensor, indices: torch.Tensor):
        """z [N, l], indices [N, K] global expert ids -> (z_perm [P, l] expert-major, counts [E_local], ctx)."""
        num_tokens, top_k = indices.shape
        flat = indices.reshape(-1)  # pair p is token p // K, slot p % K
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


def apply_expert_parallel(model, ep_mesh) -> None:
    """Split every MoE layer's experts over `ep_mesh` and swap in the All-to-All dispatcher (in place)."""
    plan = {}
    for i, block in named_blocks(model):
        if isinstance(block.ffn, LatentMoE):
            plan[f"layers.{i}.ffn.experts"] = LocalParams({"w13": Shard(0), "w2": Shard(0)})
            block.ffn.dispatcher = NativeDispatcher(ep_mesh, block.ffn.num_experts)
    parallelize_module(model, ep_mesh, plan)
