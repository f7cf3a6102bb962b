"""One device's routed path fused: gather, expert GLU, weighting and combine per tile of expert rows (docs/design.md §1.2).

LatentMoE's three steps (dispatch, experts, combine) each hand a whole-batch tensor to the next: the permuted rows
z_perm [M, l], the expert output [M, l], and in the backward their gradients (M = N * K routed rows; at T = 4096,
top-8, l = 256 each is 33 MB, above glibc's 32 MiB mmap threshold, so every call maps and faults in fresh pages),
plus an autograd node per combine tile whose backward zero-fills a whole [M, l] gradient. Here all three run per
tile of whole experts (ops.grouped_experts.expert_tiles) in one autograd.Function, so every intermediate is a
cache-sized tile and the only whole-batch tensors are [N, l]:

    forward, per tile    z_t   = z[token of each row]                 a gather (index_select)
                         pre   = z_t W13 ;  y_t = act(pre) W2         one GEMM per expert
                         mixed[token] += w_row * y_t                  an index_add into [N, l] fp32
    backward, per tile   g_t   = dmixed[token]                        a gather
                         dweights[pair of row] = <g_t, y_t>           one dot per row, written to its own slot
                         dy_t  = w_row * g_t, then the experts' backward -> dz_t, dW13 and dW2 blocks
                         dz[token] += dz_t                            an index_add into [N, l]

w_row is the routing weight of the row's (token, slot) pair; y_t and pre are kept per tile for the backward.
The GEMMs are one torch.mm per expert with out= into the tile's buffer (torch._grouped_mm on CPU is the same
loop of per-group GEMMs, without out=), in any dtype. The plain twin is the steps path (LocalDispatcher +
LatentExperts.forward_reference); tests/test_moe_strategies.py compares outputs and every gradient.
"""
from __future__ import annotations

from itertools import accumulate

import torch
from torch.profiler import record_function

from latentmoe_lab.ops.backend import resolve_backend
from latentmoe_lab.ops.fused_glu import glu_backward
from latentmoe_lab.ops.grouped_experts import expert_tiles, glu_activation
from latentmoe_lab.ops.routing import DispatchPlan


# Expert-major rows per tile. The tile buffers are per-call workspaces written with out= (a fresh multi-MB tensor
# per tile costs a page fault per 4 KiB each time glibc maps or trims it: under the profiler the step ran ~2x
# faster with glibc told never to trim). CPU seconds of the step at T = 4096, top-8, l = 256, 1 thread,
# tiles of 1024 / 2048 / 4096 rows: forward 265 / 242 / 236 ms, forward + backward 1319 / 1353 / 1411 ms.
FUSED_TILE_ROWS = 2048


def on_torch_backend(z: torch.Tensor) -> bool:
    """The fused step is plain PyTorch: it stands in for the grouped product only where that product would run
    on the torch backend ("auto" resolved for z; a forced Triton backend keeps its grouped_gemm kernels)."""
    return resolve_backend("auto", z) == "torch"


class _TilePlan:
    """Tiles of whole experts over the expert-major rows (`expert_tiles`), host-side.

    tiles:  (first expert, stop expert, first row, rows) per tile
    bounds: per tile, each expert's (start, end) rows inside the tile
    most_rows: the largest tile's rows (the workspaces' size); empty: the experts without rows
    """

    def __init__(self, counts: list[int], tile_rows: int):
        self.tiles = expert_tiles(counts, tile_rows)
        self.bounds = []
        for first, stop, _, _ in self.tiles:
            ends = list(accumulate(counts[first:stop]))
            self.bounds.append(list(zip([0] + ends[:-1], ends)))
        self.most_rows = max(rows for _, _, _, rows in self.tiles)
        self.empty = [expert for expert, count in enumerate(counts) if count == 0]


def _rows_times(a: torch.Tensor, w: torch.Tensor, bounds, out: torch.Tensor) -> torch.Tensor:
    """out[s:e] = a[s:e] @ w[j] for the rows (s, e) of each expert j of a tile: a [r, k], w [E_t, k, n], out [r, n]."""
    for j, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(a[start:end], w[j], out=out[start:end])
    return out


def _columns_times(a: torch.Tensor, b: torch.Tensor, bounds, out: torch.Tensor) -> None:
    """out[j] = a[s:e]^T @ b[s:e] per expert j with rows (the weight gradients): a [r, k], b [r, n], out [E_t, k, n]."""
    for j, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(a[start:end].t(), b[start:end], out=out[j])


class _FusedRoutedExperts(torch.autograd.Function):
    """z [N, l], weights [N, K] -> mixed [N, l] fp32 = sum_k weights[n, k] Expert_{indices[n, k]}(z[n])."""

    @staticmethod
    def forward(ctx, z, weights, w13, w2, token_index, pair_of_row, plan, clamp, situ_betas, records):
        # pre and out of every tile, for the backward. needs_input_grad stays True under no_grad (the weights
        # require grad), so `records` says whether a graph is recorded at all: else every tile reuses one workspace
        # instead of fresh multi-MB buffers whose pages fault in on first write (~35% of a forward at T = 4096)
        keep = records and any(ctx.needs_input_grad[:4])
        latent, inter, most = z.shape[1], w2.shape[1], plan.most_rows
        row_weight = weights.reshape(-1).float().index_select(0, pair_of_row)  # [M]
        mixed = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        z_rows, weighted = z.new_empty(most, latent), mixed.new_empty(most, latent)
        pre_space, out_space = (None, None) if keep else (z.new_empty(most, 2 * inter), z.new_empty(most, latent))
        pres, outputs = [], []
        for (first, stop, row, rows), bounds in zip(plan.tiles, plan.bounds):
            tokens = token_index[row:row + rows]
            z_t = torch.index_select(z, 0, tokens, out=z_rows[:rows])
            pre = _rows_times(z_t, w13[first:stop], bounds, z.new_empty(rows, 2 * inter) if keep else pre_space[:rows])
            out = _rows_times(glu_activation(pre, clamp, situ_betas), w2[first:stop], bounds,
                              z.new_empty(rows, latent) if keep else out_space[:rows])
            with record_function("moe.combine"):
                mixed.index_add_(0, tokens, torch.mul(out.float(), row_weight[row:row + rows, None],
                                                      out=weighted[:rows]))
            if keep:
                pres.append(pre)
                outputs.append(out)
        ctx.save_for_backward(z, w13, w2, token_index, pair_of_row, row_weight, *pres, *outputs)
        ctx.plan, ctx.clamp, ctx.situ_betas = plan, clamp, situ_betas
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
        return mixed

    @staticmethod
    def backward(ctx, grad_mixed):
        z, w13, w2, token_index, pair_of_row, row_weight, *saved = ctx.saved_tensors
        plan = ctx.plan
        pres, outputs = saved[:len(plan.tiles)], saved[len(plan.tiles):]
        need_z, need_weights, need_w13, need_w2 = ctx.needs_input_grad[:4]
        latent, inter, most = z.shape[1], w2.shape[1], plan.most_rows
        grad_mixed = grad_mixed.float().contiguous()
        grad_rows, z_rows = grad_mixed.new_empty(most, latent), z.new_empty(most, latent)
        grad_act, grad_in = z.new_empty(most, inter), z.new_empty(most, latent)
        grad_pre_space = z.new_empty(most, 2 * inter)
        # fp32 at least: a token's K rows are summed here, as the forward's combine sums them
        grad_z = torch.zeros(z.shape, dtype=torch.promote_types(z.dtype, torch.float32), device=z.device)
        grad_pair = torch.zeros(pair_of_row.shape[0], dtype=torch.float32, device=z.device)
        grad_w13, grad_w2 = (torch.empty_like(w13) if need_w13 else None), (torch.empty_like(w2) if need_w2 else None)
        for (first, stop, row, rows), bounds, pre, out in zip(plan.tiles, plan.bounds, pres, outputs):
            tokens = token_index[row:row + rows]
            grad_t = torch.index_select(grad_mixed, 0, tokens, out=grad_rows[:rows])  # d mixed of each row's token
            if need_weights:
                grad_pair.index_copy_(0, pair_of_row[row:row + rows], (grad_t * out.float()).sum(-1))
            grad_out = grad_t.mul_(row_weight[row:row + rows, None]).to(z.dtype)
            grad_act_t = _rows_times(grad_out, w2[first:stop].transpose(1, 2), bounds, grad_act[:rows])
            # d pre (gate | up halves) and the activation for dW2 from one pass of the slopes (ops.fused_glu); the
            # gate contiguous as in the forward's glu_activation, so act has the forward's bits
            grad_pre = grad_pre_space[:rows]
            act = glu_backward(pre[:, :inter].contiguous(), pre[:, inter:], grad_act_t, grad_pre[:, :inter],
                               grad_pre[:, inter:], ctx.clamp, ctx.situ_betas)
            if need_w2:
                _columns_times(act, grad_out, bounds, grad_w2[first:stop])
            if need_w13:
                z_t = torch.index_select(z, 0, tokens, out=z_rows[:rows])
                _columns_times(z_t, grad_pre, bounds, grad_w13[first:stop])
            if need_z:
                grad_in_t = _rows_times(grad_pre, w13[first:stop].transpose(1, 2), bounds, grad_in[:rows])
                grad_z.index_add_(0, tokens, grad_in_t.to(grad_z.dtype))
        for grad in (grad_w13, grad_w2):
            if grad is not None and plan.empty:  # experts without rows: a zero gradient, as through the twin
                grad[plan.empty] = 0
        return (grad_z.to(z.dtype) if need_z else None,
                grad_pair.view(ctx.weights_shape).to(ctx.weights_dtype) if need_weights else None,
                grad_w13, grad_w2, None, None, None, None, None, None)


def fused_routed_experts(z: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan, w13: torch.Tensor,
                         w2: torch.Tensor, clamp: float | None = None,
                         situ_betas: tuple[float, float] | None = None, tile_rows: int | None = None) -> torch.Tensor:
    """sum_k weights[n, k] Expert_{I[n, k]}(z[n]) for every token: z [N, l], weights [N, K], plan from
    `ops.routing.plan_dispatch(indices, E)`, w13 [E, l, 2F], w2 [E, F, l] -> [N, l] fp32.

    The experts are GLUs as in ops.grouped_experts (SwiGLU with the optional clamp, or SiTU with situ_betas).
    tile_rows: expert-major rows per tile (default ops.routing.CPU_TILE_ROWS; an expert with more rows is a tile of
    its own). Differentiable in z, weights, w13 and w2; the counts are read on the host (not for torch.compile).
    """
    if z.dim() != 2 or w13.dim() != 3 or w13.shape[1] != z.shape[1] or w13.shape[2] % 2:
        raise ValueError(f"z, w13: expected z [N, l] and w13 [E, l, 2F], got {tuple(z.shape)} and {tuple(w13.shape)}")
    if w2.dim() != 3 or tuple(w2.shape) != (w13.shape[0], w13.shape[2] // 2, z.shape[1]):
        raise ValueError(f"w2: expected shape [E={w13.shape[0]}, F={w13.shape[2] // 2}, l={z.shape[1]}], "
                         f"got {tuple(w2.shape)}")
    if z.dtype != w13.dtype or z.dtype != w2.dtype:
        raise TypeError(f"w13, w2: dtypes {w13.dtype}, {w2.dtype} must match z's {z.dtype}")
    if weights.dim() != 2 or weights.shape != (z.shape[0], plan.top_k):
        raise ValueError(f"weights: expected shape [N={z.shape[0]}, K={plan.top_k}], got {tuple(weights.shape)}")
    if plan.counts.shape != (w13.shape[0],):
        raise ValueError(f"plan: built for {plan.counts.shape[0]} experts, the weights hold {w13.shape[0]}")
    tile_rows = FUSED_TILE_ROWS if tile_rows is None else tile_rows
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows: must be a positive integer, got {tile_rows!r}")
    tiles = _TilePlan(plan.counts.tolist(), tile_rows)
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (z, weights, w13, w2))
    return _FusedRoutedExperts.apply(z, weights, w13, w2, plan.token_index, plan.order, tiles, clamp, situ_betas,
                                     records)
