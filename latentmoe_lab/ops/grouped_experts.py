"""Routed SwiGLU experts on CPU, forward and backward through torch._grouped_mm (docs/design.md §1.2).

The rows of E experts arrive expert-major (z [M, l], counts [E]). torch._grouped_mm multiplies each expert's
slice of rows by its own weight in one call (on CPU a C++ loop of exact-size GEMMs: no padding, no
per-expert Python), but has no CPU backward; this module gives it one, written out with the SwiGLU fused:

    pre  = z W13                 [M, 2F], gate | up halves (group e: rows of expert e times w13[e])
    act  = silu(min(gate, c)) * clamp(up, -c, c)      or, with situ_betas, situ(gate, up) (K3, design §18)
    y    = act W2                [M, l]

    dact = dy W2^T               dW2 = act^T dy   (2-D x 2-D grouped product: one [F, l] block per expert)
    dgate, dup from dact, the SwiGLU derivative with the clamp's pass-through masks, into one [M, 2F] buffer
    dW13 = z^T [dgate | dup]     dz  = [dgate | dup] W13^T

so a step is 3 grouped GEMMs forward, 4 backward, and one elementwise pass each way; nothing is gathered,
padded or concatenated per expert. Rows go in tiles of ops.routing.CPU_TILE_ROWS so the [rows, 2F]
pre-activation stays in cache (and below glibc's mmap threshold), the weight gradients summed over tiles.

The plain twin is `ops.routing.grouped_matmul_reference` + `swiglu` per expert (LatentExperts.forward_reference);
tests/test_moe_fast.py compares outputs and gradients on ragged routing.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from latentmoe_lab.ops import routing
from latentmoe_lab.ops.activations import situ_grads


def fits(z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """This path applies: plain CPU tensors (no DTensor), fp32 / bf16 of one dtype, rows of 16-byte multiples
    (torch._grouped_mm's rule). Under torch.compile the path runs as an opaque custom op (see
    grouped_swiglu_experts): _grouped_mm's own fake-tensor rule takes bf16 only."""
    plain = all(isinstance(t, torch.Tensor) and type(t).__name__ != "DTensor" for t in (z, w13, w2))
    return (plain and z.device.type == "cpu" and hasattr(torch, "_grouped_mm")
            and z.dtype in (torch.float32, torch.bfloat16)
            and z.dtype == w13.dtype == w2.dtype
            and all(size * z.element_size() % 16 == 0 for size in (w13.shape[1], w13.shape[2], w2.shape[1])))


def glu_activation(pre: torch.Tensor, clamp: float | None, situ_betas=None) -> torch.Tensor:
    """pre [r, 2F] (gate | up) -> silu(min(gate, c)) * clamp(up, -c, c) [r, F] (ops.routing.swiglu's form),
    or situ(gate, up, *situ_betas) (ops.routing.expert_glu's other form)."""
    gate, up = pre.chunk(2, dim=-1)
    gate = gate.contiguous()  # torch's CPU silu / sigmoid run ~8x slower on a strided half than on a copy
    if situ_betas is not None:
        return routing.expert_glu(gate, up, clamp, tuple(situ_betas))
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return F.silu(gate).mul_(up)


def glu_activation_backward(pre: torch.Tensor, grad_act: torch.Tensor, clamp: float | None,
                            situ_betas=None) -> torch.Tensor:
    """d act / d pre: pre [r, 2F], grad_act [r, F] (consumed) -> grad_pre [r, 2F] (gate | up halves)."""
    inter = grad_act.shape[1]
    gate, up = pre[:, :inter].contiguous(), pre[:, inter:]  # contiguous: see glu_activation
    if situ_betas is not None:  # d/dg = A'(g) B(u), d/du = A(g) B'(u)
        gate_factor, gate_slope, up_factor, up_slope = situ_grads(gate, up, *situ_betas)
        return torch.cat([grad_act * gate_slope * up_factor, grad_act * gate_factor * up_slope], dim=-1)
    clamped_gate, clamped_up = (gate, up) if clamp is None else (gate.clamp(max=clamp), up.clamp(-clamp, clamp))
    grad_up = grad_act * F.silu(clamped_gate)
    # aten's silu_backward: grad * silu'(g), silu'(g) = sig + g sig (1 - sig), in one vectorized pass
    grad_gate = torch.ops.aten.silu_backward(grad_act.mul_(clamped_up), clamped_gate)
    grad_pre = torch.cat([grad_gate, grad_up], dim=-1)
    if clamp is not None:  # torch.clamp passes the gradient where its input lies within the bounds
        grad_pre[:, :inter].masked_fill_(gate > clamp, 0.0)
        grad_pre[:, inter:].masked_fill_(up.abs() > clamp, 0.0)
    return grad_pre


def expert_tiles(counts: list[int], tile_rows: int) -> list[tuple[int, int, int, int]]:
    """Consecutive expert ranges of at most tile_rows rows (an expert with more is a tile of its own):
    (first expert, stop expert, first row, rows) per tile, at least one. counts: rows per expert (host ints)."""
    tiles, first, row, rows = [], 0, 0, 0
    for expert, count in enumerate(counts):
        if expert > first and rows + count > tile_rows:
            tiles.append((first, expert, row, rows))
            first, row, rows = expert, row + rows, 0
        rows += count
    tiles.append((first, len(counts), row, rows))
    return tiles


def _forward_tiles(z, w13, w2, offsets, tiles, clamp, situ_betas=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """y [M, l] and each tile's pre-activation [rows, 2F] (kept for the backward)."""
    pieces, pres = [], []
    for first, stop, row, rows in tiles:
        offs = offsets[first:stop]
        pre = torch._grouped_mm(z[row:row + rows], w13[first:stop], offs=offs)
        pieces.append(torch._grouped_mm(glu_activation(pre, clamp, situ_betas), w2[first:stop], offs=offs))
        pres.append(pre)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), pres


def _backward_tiles(grad_y, z, w13, w2, offsets, tiles, clamp, pres, need_w13: bool = True, need_w2: bool = True,
                    situ_betas=None):
    """(grad z [M, l], grad w13 [E, l, 2F] or None, grad w2 [E, F, l] or None) from grad_y [M, l]."""
    grad_y = grad_y.contiguous()
    grad_z, grad_w13, grad_w2 = [], [], []
    for (first, stop, row, rows), pre in zip(tiles, pres):
        offs, grad_y_tile, tile_w13, tile_w2 = offsets[first:stop], grad_y[row:row + rows], w13[first:stop], w2[first:stop]
        grad_pre = glu_activation_backward(pre, torch._grouped_mm(grad_y_tile, tile_w2.transpose(1, 2), offs=offs),
                                        clamp, situ_betas)
        if need_w2:
            grad_w2.append(torch._grouped_mm(glu_activation(pre, clamp, situ_betas).t(), grad_y_tile, offs=offs))
        if need_w13:
            grad_w13.append(torch._grouped_mm(z[row:row + rows].t(), grad_pre, offs=offs))
        grad_z.append(torch._grouped_mm(grad_pre, tile_w13.transpose(1, 2), offs=offs))
    join = lambda parts: None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731
    return join(grad_z), join(grad_w13), join(grad_w2)


class _GroupedSwiGLUExperts(torch.autograd.Function):
    """z [M, l] expert-major, w13 [E, l, 2F], w2 [E, F, l] -> [M, l]; tiles from `expert_tiles`, offsets [E]
    int32 end offsets of each expert's rows inside its tile. Tiles end at expert boundaries, so each weight
    gradient block comes from one tile (no whole-weight partial sums to add up)."""

    @staticmethod
    def forward(ctx, z, w13, w2, offsets, tiles, clamp, situ_betas):
        y, pres = _forward_tiles(z, w13, w2, offsets, tiles, clamp, situ_betas)
        ctx.save_for_backward(z, w13, w2, offsets, *pres)
        ctx.tiles, ctx.clamp, ctx.situ_betas = tiles, clamp, situ_betas
        return y

    @staticmethod
    def backward(ctx, grad_y):
        z, w13, w2, offsets, *pres = ctx.saved_tensors
        grads = _backward_tiles(grad_y, z, w13, w2, offsets, ctx.tiles, ctx.clamp, pres,
                                ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.situ_betas)
        return *grads, None, None, None, None


def _plan(counts: torch.Tensor) -> tuple[list[tuple[int, int, int, int]], torch.Tensor]:
    """counts [E] -> (tiles of `expert_tiles`, int32 end offsets of each expert's rows inside its tile)."""
    host_counts = counts.tolist()
    tiles = expert_tiles(host_counts, routing.CPU_TILE_ROWS)
    offsets = torch.tensor([end for first, stop, _, _ in tiles for end in accumulate(host_counts[first:stop])],
                           dtype=torch.int32)
    return tiles, offsets


def grouped_swiglu_experts(z: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           clamp: float | None = None, situ_betas: tuple[float, float] | None = None) -> torch.Tensor:
    """Expert_e(z_r) for every expert-major row: z [M, l], counts [E] int, w13 [E, l, 2F], w2 [E, F, l] -> [M, l].

    The activation is SwiGLU (with the optional clamp), or SiTU with situ_betas = (beta_gate, beta_up).

    Rows counts[:e].sum() : counts[:e+1].sum() go to expert e (the LatentExperts contract). Needs `fits`.
    Under torch.compile the same kernels run as one opaque custom op (`latentmoe::grouped_swiglu_experts`):
    the host-side tiling reads the counts, which a graph cannot.
    """
    if z.dim() != 2 or w13.dim() != 3 or w13.shape[1] != z.shape[1] or w13.shape[2] % 2:
        raise ValueError(f"z, w13: expected z [M, l] and w13 [E, l, 2F], got {tuple(z.shape)} and {tuple(w13.shape)}")
    if w2.dim() != 3 or tuple(w2.shape) != (w13.shape[0], w13.shape[2] // 2, z.shape[1]):
        raise ValueError(f"w2: expected shape [E={w13.shape[0]}, F={w13.shape[2] // 2}, l={z.shape[1]}], "
                         f"got {tuple(w2.shape)}")
    if not fits(z, w13, w2):
        raise ValueError("z: grouped_swiglu_experts needs CPU fp32/bf16 tensors of one dtype and rows of 16-byte "
                         "multiples (see fits)")
    if torch.compiler.is_compiling():  # the counts check runs inside the op, on the real tensors
        return torch.ops.latentmoe.grouped_swiglu_experts(z, counts, w13, w2, clamp,
                                                          None if situ_betas is None else list(situ_betas))[0]
    routing.check_grouped_args(z, w13, counts.cumsum(0))
    tiles, offsets = _plan(counts)
    return _GroupedSwiGLUExperts.apply(z, w13, w2, offsets, tiles, clamp, situ_betas)


# ---- the same computation as a torch.library custom op: opaque to torch.compile, differentiable through AOT
# autograd (register_autograd), with fake rules that give the output shapes without reading the counts.

@torch.library.custom_op("latentmoe::grouped_swiglu_experts", mutates_args=())
def _experts_op(z: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                clamp: float | None, situ_betas: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y [M, l], the pre-activation [M, 2F] that the backward reads)."""
    routing.check_grouped_args(z, w13, counts.cumsum(0))
    tiles, offsets = _plan(counts)
    y, pres = _forward_tiles(z, w13, w2, offsets, tiles, clamp, situ_betas)
    return y.contiguous(), (pres[0] if len(pres) == 1 else torch.cat(pres)).contiguous()


@_experts_op.register_fake
def _(z, counts, w13, w2, clamp, situ_betas=None):
    return z.new_empty(z.shape), z.new_empty(z.shape[0], w13.shape[2])


@torch.library.custom_op("latentmoe::grouped_swiglu_experts_backward", mutates_args=())
def _experts_backward_op(grad_y: torch.Tensor, z: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, pre: torch.Tensor, clamp: float | None, situ_betas: list[float] | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (grad z [M, l], grad w13 [E, l, 2F], grad w2 [E, F, l])."""
    tiles, offsets = _plan(counts)
    pres = [pre[row:row + rows] for _, _, row, rows in tiles]
    grads = _backward_tiles(grad_y, z, w13, w2, offsets, tiles, clamp, pres, situ_betas=situ_betas)
    return tuple(grad.contiguous() for grad in grads)


@_experts_backward_op.register_fake
def _(grad_y, z, counts, w13, w2, pre, clamp, situ_betas):
    return z.new_empty(z.shape), w13.new_empty(w13.shape), w2.new_empty(w2.shape)


def _experts_setup_context(ctx, inputs, output):
    z, counts, w13, w2, clamp, situ_betas = inputs
    ctx.save_for_backward(z, counts, w13, w2, output[1])
    ctx.clamp, ctx.situ_betas = clamp, situ_betas


def _experts_op_backward(ctx, grad_y, _grad_pre):
    z, counts, w13, w2, pre = ctx.saved_tensors
    grad_z, grad_w13, grad_w2 = _experts_backward_op(grad_y, z, counts, w13, w2, pre, ctx.clamp, ctx.situ_betas)
    return grad_z, None, grad_w13, grad_w2, None, None


_experts_op.register_autograd(_experts_op_backward, setup_context=_experts_setup_context)
