"""Grouped GEMM over expert-major rows (optionally with SwiGLU fused), and the weighted combine.

Math (docs/design.md §1.2): rows offsets[e-1]:offsets[e] of x [M, D_in] belong to expert e and meet w[e]:

    plain:   out = x_e @ w[e]                                  w: [E, D_in, D_out]
    SwiGLU:  out = silu(x_e @ w[e][:, :F]) * (x_e @ w[e][:, F:])   w: [E, D_in, 2F] (gate | up)
    combine: out[n] = sum_k weights[n, k] * y[row of (n, k)]       fp32

Blocking: the output is cut into BLOCK_M x BLOCK_N tiles that never straddle two experts, so each
tile multiplies by a single weight matrix. Expert e needs ceil(count_e / BLOCK_M) row tiles; a tiny
torch prologue lays them out back to back and gives each tile its (expert, first row, end row). The
grid is sized by the bound ceil(M / BLOCK_M) + E, known without reading counts back to the host;
tiles past the end exit at once. Each program walks D_in in BLOCK_K steps with an fp32 accumulator.
In SwiGLU mode it keeps two accumulators, gate and up columns of the same tile, and applies
silu(gate) * up (with the optional clamp on gate and up) before the single store, so the 2F-wide pre-activation is never
written out.

The combine runs per token block instead of per row: each token gathers its K rows and adds them with
their routing weights. That is the same scatter back to token order, but with no atomics, so it is
deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentmoe_kernels import reject_interpreted_bf16


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_start_ptr, tile_row_end_ptr,
                         d_in, d_out, clamp,
                         SWIGLU: tl.constexpr, HAS_CLAMP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    if row_start >= row_end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * D_in can pass 2**31
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < d_out
    # w[e] is [D_in, D_out] in plain mode and [D_in, 2 * D_out] (gate | up) in SwiGLU mode.
    w_width = 2 * d_out if SWIGLU else d_out
    w_expert = w_ptr + expert * d_in * w_width

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # the gate columns in SwiGLU mode
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < d_in
        x = tl.load(x_ptr + rows[:, None] * d_in + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_at = w_expert + ks[:, None] * w_width + cols[None, :]
        w_ok = k_ok[:, None] & col_ok[None, :]
        acc = tl.dot(x, tl.load(w_at, mask=w_ok, other=0.0), acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            acc_up = tl.dot(x, tl.load(w_at + d_out, mask=w_ok, other=0.0), acc_up, input_precision=DOT_PRECISION)

    out = acc
    if SWIGLU:
        if HAS_CLAMP:  # docs/design.md §1.2: bound both inputs of the product, not the product
            acc = tl.minimum(acc, clamp)
            acc_up = tl.minimum(tl.maximum(acc_up, -clamp), clamp)
        out = acc * tl.sigmoid(acc) * acc_up
    tl.store(out_ptr + rows[:, None] * d_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, row_of_pair_ptr, out_ptr, num_tokens, width,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < num_tokens
    tile_ok = token_ok[:, None] & (cols < width)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for slot in range(TOP_K):
        pair = tokens * TOP_K + slot
        row = tl.load(row_of_pair_ptr + pair, mask=token_ok, other=0)
        weight = tl.load(weights_ptr + pair, mask=token_ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * width + cols[None, :], mask=tile_ok, other=0.0)
        acc += weight[:, None] * y.to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * width + cols[None, :], acc, mask=tile_ok)


def _tile_schedule(offsets: torch.Tensor, num_rows: int, block_m: int):
    """Per row tile: (expert, first row, end row); tiles past the last expert get an empty range."""
    offsets = offsets.long()
    num_experts = offsets.shape[0]
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts
    tile = torch.arange(max_tiles, device=offsets.device)
    expert = torch.searchsorted(tile_end, tile, right=True).clamp(max=num_experts - 1)
    in_use = tile < tile_end[-1]
    row_start = offsets[expert] - counts[expert] + (tile - (tile_end[expert] - tiles[expert])) * block_m
    row_end = torch.where(in_use, offsets[expert], 0)
    return expert.to(torch.int32), row_start.to(torch.int32), row_end.to(torch.int32), max_tiles


def _launch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, d_out: int, swiglu: bool,
            clamp: float | None) -> torch.Tensor:
    reject_interpreted_bf16(x=x)
    num_rows, d_in = x.shape
    out = torch.empty(num_rows, d_out, dtype=x.dtype, device=x.device)
    if num_rows == 0 or d_out == 0:
        return out
    # Decode-sized batches leave most experts a handful of rows: 16-row tiles waste less there.
    block_m = 16 if num_rows <= 16 * w.shape[0] else 64
    block_n = min(64 if swiglu else 128, max(16, triton.next_power_of_2(d_out)))
    block_k = min(64, max(16, triton.next_power_of_2(d_in)))
    expert, row_start, row_end, max_tiles = _tile_schedule(offsets, num_rows, block_m)
    grid = (max_tiles, triton.cdiv(d_out, block_n))
    _grouped_gemm_kernel[grid](
        x.contiguous(), w.contiguous(), out, expert, row_start, row_end, d_in, d_out,
        0.0 if clamp is None else float(clamp),
        SWIGLU=swiglu, HAS_CLAMP=clamp is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x [M, D_in] times w[e] [D_in, D_out] -> [M, D_out] in x's dtype.

    offsets: [E] end offsets (non-decreasing, ending at M). Accumulates in fp32.
    """
    return _launch(x, w, offsets, w.shape[2], swiglu=False, clamp=None)


def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, offsets: torch.Tensor,
                   clamp: float | None = None) -> torch.Tensor:
    """silu(x_e @ gate_e) * (x_e @ up_e) -> [M, F] in x's dtype; clamp c: silu(min(gate, c)) * clamp(up, -c, c).

    x: [M, D] expert-major rows; w13: [E, D, 2F] with gate columns first; offsets: [E] end offsets.
    """
    return _launch(x, w13, offsets, w13.shape[2] // 2, swiglu=True, clamp=clamp)


def combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """sum_k weights[n, k] * y[row of (n, k)] -> [N, D] fp32.

    y: [N*K, D] expert-major rows; weights: [N, K]; order: [N*K] flat (token * K + slot) index of each row.
    """
    num_tokens, top_k = weights.shape
    width = y.shape[1]
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=y.device)
    if num_tokens == 0 or width == 0:
        return out
    row_of_pair = torch.empty_like(order)  # the inverse permutation
    row_of_pair[order] = torch.arange(order.numel(), device=order.device)
    block_t, block_d = 16, min(128, triton.next_power_of_2(width))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_d))
    _combine_kernel[grid](y.contiguous(), weights.contiguous(), row_of_pair, out, num_tokens, width,
                          TOP_K=top_k, BLOCK_T=block_t, BLOCK_D=block_d)
    return out
