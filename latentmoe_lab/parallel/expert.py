"""Expert parallelism: an All-to-All dispatcher for LatentMoE and the MoE wrapper that overlaps it.

Rank r of the ep group holds experts [r*E/R, (r+1)*E/R). Per MoE layer and rank (N local tokens,
top-K, latent size l):

  dispatch  1. counts  all_to_all [R] int64: rows this rank sends to each rank (sizes the buffers)
            2. tokens  all_to_all [S, l]: one row per (token, destination rank) pair, grouped by
               rank -- a token bound for several experts on one rank travels once, in the latent size
            3. meta    all_to_all [S, 2K] int32: per row the K local expert ids (-1 = not this rank)
               and the K routing weights (fp32 bits), so the receiver can sum its experts' outputs
  experts   the receiver expands rows to (row, expert) pairs, sorts them expert-major, runs its experts
  combine   4. back    all_to_all [S, l]: per received row the weighted sum over this rank's experts,
               returned to the sender, which adds the R partial sums in fp32.
            With tp > 1 the experts hold 1/tp of their width: the sum is then all-reduced over tp,
            so RMSNorm_l sees the *complete* expert sum (norm of a partial sum is wrong).

`AllToAllDispatcher` implements `layers.moe.Dispatcher` (then the weights travel in `combine`
instead of with the tokens). `ParallelMoE` drives it directly: it starts the token All-to-All
asynchronously and runs the shared experts while the rows are in flight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.parallel.comm import Comm, PendingTensor
from latentmoe_lab.parallel.sequence import SequenceLayout, gather_sequence, shard_sequence


def expert_range(num_experts: int, ep: int, ep_index: int) -> range:
    """Experts held by member ep_index of an ep group of size ep."""
    per_rank = num_experts // ep
    return range(ep_index * per_rank, (ep_index + 1) * per_rank)


class LoadStats:
    """Running per-rank counters of one dispatcher (one MoE layer on one rank).

    rows_to[r]: token rows sent to ep member r; pairs_to[r]: (token, expert) pairs bound for r;
    rows_received: rows this rank's experts processed for others; expert_pairs[e]: pairs per local expert.
    """

    def __init__(self, ep: int, local_experts: int):
        self.rows_to = torch.zeros(ep, dtype=torch.int64)
        self.pairs_to = torch.zeros(ep, dtype=torch.int64)
        self.rows_received = 0
        self.expert_pairs = torch.zeros(local_experts, dtype=torch.int64)

    def as_dict(self) -> dict:
        return {"rows_to": self.rows_to.tolist(), "pairs_to": self.pairs_to.tolist(),
                "rows_received": int(self.rows_received), "expert_pairs": self.expert_pairs.tolist()}


@dataclass
class DispatchContext:
    """What combine needs. S sent rows, S_in received rows, P local (row, expert) pairs, expert-major."""

    token_of_row: torch.Tensor  # [S] local token of each sent row
    send_counts: list[int]
    recv_counts: list[int]
    dest_mask: torch.Tensor  # [S, K] slot k of sent row goes to the row's destination rank
    pair_row: torch.Tensor  # [P] received row of each local pair
    pair_slot: torch.Tensor  # [P] top-k slot of each local pair
    recv_weights: torch.Tensor | None  # [S_in, K] fp32, None until combine ships them
    num_tokens: int


class PendingDispatch:
    """The token and meta All-to-Alls in flight; `wait()` -> (z_perm [P, l], counts [E_local], ctx)."""

    def __init__(self, dispatcher: "AllToAllDispatcher", tokens: PendingTensor, meta: PendingTensor,
                 ctx: DispatchContext, top_k: int, weights_shipped: bool):
        self._dispatcher, self._tokens, self._meta, self._ctx = dispatcher, tokens, meta, ctx
        self._top_k, self._weights_shipped = top_k, weights_shipped

    def wait(self):
        received, meta = self._tokens.wait(), self._meta.wait()
        local_ids = meta[:, :self._top_k].long()
        if self._weights_shipped:
            self._ctx.recv_weights = meta[:, self._top_k:].contiguous().view(torch.float32)
        pair_row, pair_slot = (local_ids >= 0).nonzero(as_tuple=True)
        expert = local_ids[pair_row, pair_slot]
        order = torch.argsort(expert, stable=True)
        self._ctx.pair_row, self._ctx.pair_slot = pair_row[order], pair_slot[order]
        counts = torch.bincount(expert, minlength=self._dispatcher.local_experts)
        stats = self._dispatcher.stats
        stats.rows_received += received.shape[0]
        stats.expert_pairs += counts.cpu()
        return received[self._ctx.pair_row], counts, self._ctx


class AllToAllDispatcher:
    """Moves latent tokens to the ep rank holding each selected expert and the weighted sums back."""

    def __init__(self, comm: Comm, num_experts: int):
        self.comm = comm
        self.ep, self.ep_index = comm.mesh.size("ep"), comm.mesh.index("ep")
        self.local_experts = num_experts // self.ep
        self.stats = LoadStats(self.ep, self.local_experts)

    @record_function("moe.dispatch")
    def dispatch_async(self, z: torch.Tensor, indices: torch.Tensor,
                       weights: torch.Tensor | None = None) -> PendingDispatch:
        """z [N, l], indices [N, K] global expert ids, weights [N, K] (optional, ships with the tokens)."""
        num_tokens, top_k = indices.shape
        dest = indices // self.local_experts  # [N, K] ep member holding each selected expert
        hits = torch.zeros(num_tokens, self.ep, dtype=torch.bool, device=z.device)
        hits.scatter_(1, dest, True)
        rank_of_row, token_of_row = hits.t().nonzero(as_tuple=True)  # grouped by destination, token order
        send_counts = hits.sum(0)
        dest_mask = dest[token_of_row] == rank_of_row[:, None]  # [S, K]
        local_ids = torch.where(dest_mask, indices[token_of_row] % self.local_experts, -1).int()
        meta = local_ids
        if weights is not None:
            row_weights = weights.float()[token_of_row].masked_fill(~dest_mask, 0.0)
            meta = torch.cat([local_ids, row_weights.view(torch.int32)], dim=1)
        self.stats.rows_to += send_counts.cpu()
        self.stats.pairs_to += torch.bincount(dest.reshape(-1), minlength=self.ep).cpu()

        recv_counts = self.comm.all_to_all(send_counts, [1] * self.ep, [1] * self.ep, "ep", "ep.counts").wait()
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()
        tokens = self.comm.all_to_all(z[token_of_row], send_list, recv_list, "ep", "ep.tokens", async_op=True)
        meta = self.comm.all_to_all(meta, send_list, recv_list, "ep", "ep.meta", async_op=True)
        ctx = DispatchContext(token_of_row, send_list, recv_list, dest_mask, None, None, None, num_tokens)
        return PendingDispatch(self, tokens, meta, ctx, top_k, weights is not None)

    # ------------------------------------------------------------- layers.moe.Dispatcher
    def dispatch(self, z: torch.Tensor, indices: torch.Tensor):
        return self.dispatch_async(z, indices).wait()

    @record_function("moe.combine")
    def combine(self, y_perm: torch.Tensor, weights: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """y_perm [P, l] in pair order -> the complete weighted expert sum [N, l] fp32 of each local token."""
        if ctx.recv_weights is None:  # protocol path: the weights were not sent with the tokens
            row_weights = weights.float()[ctx.token_of_row].masked_fill(~ctx.dest_mask, 0.0)
            ctx.recv_weights = self.comm.all_to_all(row_weights, ctx.send_counts, ctx.recv_counts,
                                                    "ep", "ep.meta").wait()
        pair_weight = ctx.recv_weights[ctx.pair_row, ctx.pair_slot]
        partial = torch.zeros(sum(ctx.recv_counts), y_perm.shape[1], dtype=torch.float32, device=y_perm.device)
        partial.index_add_(0, ctx.pair_row, y_perm.float() * pair_weight[:, None])
        back = self.comm.all_to_all(partial.to(y_perm.dtype), ctx.recv_counts, ctx.send_counts,
                                    "ep", "ep.combine").wait()
        mixed = torch.zeros(ctx.num_tokens, y_perm.shape[1], dtype=torch.float32, device=y_perm.device)
        mixed.index_add_(0, ctx.token_of_row, back.float())
        return self.comm.all_reduce(mixed, "tp", "tp.moe_routed")


class ParallelMoE(nn.Module):
    """A LatentMoE whose `experts` are this rank's shard (and whose `shared` completes its own TP sum).

    forward(x [B, T, hidden]) -> [B, T, hidden], equal to the single-device layer. With overlap,
    the shared experts run between starting and finishing the token All-to-All; without, the
    layer's own forward drives the dispatcher through the Dispatcher protocol. With sequence
    parallelism x arrives as [B, T/tp, hidden]: routing and the expert TP split need every token
    of the tp group, so the tokens are gathered first and this rank's slice is returned.
    """

    def __init__(self, layer: LatentMoE, dispatcher: AllToAllDispatcher, comm: Comm, layout: SequenceLayout,
                 overlap: bool):
        super().__init__()
        self.layer, self.dispatcher, self.comm, self.layout, self.overlap = layer, dispatcher, comm, layout, overlap
        layer.dispatcher = dispatcher

    @record_function("moe")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequence_parallel = self.layout.sequence_parallel
        if sequence_parallel:
            x = gather_sequence(self.comm, x, "tp", "sp.gather")
        out = self._overlapped(x) if self.overlap else self.layer(x)
        if sequence_parallel:
            out = shard_sequence(out, self.comm.mesh.index("tp"), self.comm.mesh.size("tp"))
        return out

    def _overlapped(self, x: torch.Tensor) -> torch.Tensor:
        """LatentMoE.forward with the shared experts moved between dispatch start and wait."""
        layer = self.layer
        layer._check_input(x)
        x_nd = rearrange(x, "b t d -> (b t) d")
        weights, indices = layer.route(x_nd)
        pending = self.dispatcher.dispatch_async(layer.down(x_nd), indices, weights)
        with record_function("moe.shared"):
            shared = None if layer.shared is None else layer.shared(x_nd)  # runs while the tokens travel
        z_perm, counts, ctx = pending.wait()
        mixed = self.dispatcher.combine(layer.experts(z_perm, counts), weights, ctx)
        layer.last_expert_counts = torch.bincount(indices.reshape(-1), minlength=layer.num_experts).detach()
        out = layer.up(layer.latent_norm(mixed).to(x_nd.dtype))
        if shared is not None:
            out = out + shared
        return rearrange(out, "(b t) d -> b t d", b=x.shape[0])
