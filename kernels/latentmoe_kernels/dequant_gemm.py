"""Grouped GEMM over packed expert weights, dequantized inside the kernel (docs/design.md §7).

    out = x_e @ dequant(W[e])^T        rows offsets[e-1]:offsets[e] of x [M, D_in]; W[e] packed [D_out, D_in]

Formats (byte layouts in latentmoe_lab/quant/weight_fp8.py and weight_mxfp4.py):
    FP8    data uint8 [E, D_out, D_in] e4m3 bits, scale fp32 [E, ceil(D_out/128), ceil(D_in/128)]
    MXFP4  data uint8 [E, D_out, nb*16] two E2M1 codes per byte (even element low), scale uint8 [E, D_out, nb]
           E8M0 exponents, nb = ceil(D_in / 32)
Each program owns a BLOCK_M x BLOCK_N output tile of one expert (the row-tile schedule of grouped_gemm.py) and
walks D_in in BLOCK_K steps: it loads the packed bytes of the [BLOCK_K, BLOCK_N] weight tile, decodes them with
integer arithmetic (no fp8 dtype needed, so the interpreter runs it too), multiplies by the scales and
accumulates x_tile @ w_tile in fp32. The weights cross memory at 1 or 0.53 bytes per value instead of 4: that
is where it pays, in decode-sized batches whose expert GEMMs are bound by weight reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentmoe_kernels import reject_interpreted_bf16
from latentmoe_kernels.grouped_gemm import _tile_schedule

FP8_BLOCK, MX_BLOCK = 128, 32


@triton.jit
def _e4m3_to_float(byte):
    """uint8 e4m3fn bit patterns (as int32) -> fp32: (1 + m/8) 2^(e-7), subnormals m/8 2^-6."""
    sign = tl.where((byte & 128) != 0, -1.0, 1.0)
    exponent = (byte >> 3) & 15
    mantissa = (byte & 7).to(tl.float32)
    normal = (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32))
    return sign * tl.where(exponent == 0, mantissa * 0.001953125, normal)  # 2^-9


@triton.jit
def _e2m1_to_float(code):
    """4-bit E2M1 codes (as int32) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    sign = tl.where((code & 8) != 0, -1.0, 1.0)
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    normal = (2.0 + mantissa) * tl.exp2((exponent - 2).to(tl.float32))
    return sign * tl.where(exponent == 0, mantissa * 0.5, normal)


@triton.jit
def _dequant_gemm_kernel(x_ptr, data_ptr, scale_ptr, out_ptr, tile_expert_ptr, tile_row_start_ptr,
                         tile_row_end_ptr, d_in, d_out, data_width, scale_rows, scale_width,
                         FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    if row_start >= row_end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < row_end
    col_ok = cols < d_out
    data_expert = data_ptr + expert * d_out * data_width
    scale_expert = scale_ptr + expert * scale_rows * scale_width

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < d_in
        x = tl.load(x_ptr + rows[:, None] * d_in + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        if FP8:
            byte = tl.load(data_expert + cols[None, :] * data_width + ks[:, None], mask=w_ok, other=0).to(tl.int32)
            scale = tl.load(scale_expert + (cols // 128)[None, :] * scale_width + (ks // 128)[:, None],
                            mask=w_ok, other=0.0)
            w = _e4m3_to_float(byte) * scale
        else:
            byte = tl.load(data_expert + cols[None, :] * data_width + (ks // 2)[:, None], mask=w_ok,
                           other=0).to(tl.int32)
            code = tl.where((ks % 2 == 0)[:, None], byte & 15, byte >> 4)
            exponent = tl.load(scale_expert + cols[None, :] * scale_width + (ks // 32)[:, None], mask=w_ok,
                               other=127).to(tl.int32)
            w = _e2m1_to_float(code) * tl.exp2((exponent - 127).to(tl.float32))
        acc = tl.dot(x.to(tl.float32), w, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + rows[:, None] * d_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def dequant_grouped_gemm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                         fmt: str, d_in: int) -> torch.Tensor:
    """x [M, d_in] expert-major rows times each expert's packed [D_out, d_in] weight, transposed -> [M, D_out].

    fmt: "fp8" | "mxfp4" (layouts above); offsets: [E] end offsets ending at M. Accumulates in fp32; the
    output has x's dtype.
    """
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"fmt: the dequant kernel takes 'fp8' or 'mxfp4', got {fmt!r}")
    reject_interpreted_bf16(x=x)
    num_rows = x.shape[0]
    d_out = data.shape[1]
    out = torch.empty(num_rows, d_out, dtype=x.dtype, device=x.device)
    if num_rows == 0 or d_out == 0:
        return out
    block_m = 16 if num_rows <= 16 * data.shape[0] else 64
    block_n = min(64, max(16, triton.next_power_of_2(d_out)))
    block_k = min(64, max(32, triton.next_power_of_2(d_in)))  # divides 128 (fp8 blocks) and 32 divides it (MX)
    expert, row_start, row_end, max_tiles = _tile_schedule(offsets, num_rows, block_m)
    grid = (max_tiles, triton.cdiv(d_out, block_n))
    _dequant_gemm_kernel[grid](
        x.contiguous(), data.contiguous(), scale.contiguous(), out, expert, row_start, row_end, d_in, d_out,
        data.shape[2], scale.shape[1], scale.shape[2], FP8=fmt == "fp8",
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
