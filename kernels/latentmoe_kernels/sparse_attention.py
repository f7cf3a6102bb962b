"""Gated DSA kernels: lightning-indexer scores with causal top-k, and sparse attention over the picks.

Math (docs/design.md §1.4): I[t, s] = sum_j w[t, j] ReLU(q_idx[t, j] . k_idx[s]); S_t = TopK_{s <= t + offset}
I[t, s], padded with -1; o[t, h] = sum_{s in S_t} softmax_s(scale q[t, h] . k[s]) v[s].

Index top-k blocking: one program per (batch, query). It streams the visible keys in blocks of KP
(k rounded up to a power of two, at least 16) and keeps the best KP keys seen so far in registers; the [T, S]
score matrix never exists. A block's scores are computed SUB keys at a time ([HI, DI] x [DI, SUB]
dots, heads as the M dimension) so the register tile stays small even at k = 2048. To merge, a
score and its position are packed into one int64 sort key, score bits on top (mapped so integer order
is float order) and 2^31 - 1 - s below, so that equal scores rank the earlier position first, as the
reference's stable sort does. tl.topk of [best | block] (2 KP keys) then keeps the best KP. Positions
past the causal limit get the smallest key and decode to -1.
This trades the sort work of a production kernel (radix select over a shared score tile) for a
kernel that reads top to bottom.

Sparse attention blocking: one program per (batch, query, key/value head, block of that head's
query heads). It gathers the selected keys BLOCK_N at a time (all heads share the selection) and
runs an online softmax in fp32: running max m, running sum l, rescaled accumulator. Index -1 is
masked out; a query with nothing selected returns 0, not NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentmoe_kernels import reject_interpreted_bf16

_EMPTY_KEY = tl.constexpr(-(2**63))  # sorts below every packed (score, position) key


@triton.jit
def _block_scores(q_idx, w, k_idx_ptr, positions, num_visible, dim_idx,
                  DI_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Index scores [SUB] of one query against the keys at `positions` of k_idx_ptr ([S, DI], one batch).

    q_idx: [HI_PAD, DI_PAD]; w: [HI_PAD] fp32 (zero for padded heads).
    """
    cols = tl.arange(0, DI_PAD)
    keys = tl.load(k_idx_ptr + positions[:, None] * dim_idx + cols[None, :],
                   mask=(positions < num_visible)[:, None] & (cols < dim_idx)[None, :], other=0.0)
    logits = tl.dot(q_idx, tl.trans(keys), input_precision=DOT_PRECISION)  # [HI_PAD, SUB]
    return tl.sum(w[:, None] * tl.maximum(logits, 0.0), axis=0)


@triton.jit
def _pack(score, position, visible):
    """int64 key ordering by (score, earlier position); invisible positions get the smallest key."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and 0.0 must tie
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float value
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - position).to(tl.int64)
    return tl.where(visible, key, _EMPTY_KEY)


@triton.jit
def _index_topk_kernel(q_idx_ptr, k_idx_ptr, w_ptr, first_key_ptr, out_ptr, num_queries, num_keys, heads_idx, dim_idx,
                       topk, offset, KP: tl.constexpr, SUB: tl.constexpr, HI_PAD: tl.constexpr, DI_PAD: tl.constexpr,
                       HAS_FIRST_KEY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    query, batch = tl.program_id(0), tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, HI_PAD)
    cols = tl.arange(0, DI_PAD)
    head_ok = heads < heads_idx
    row = batch * num_queries + query
    q_idx = tl.load(q_idx_ptr + (row * heads_idx + heads[:, None]) * dim_idx + cols[None, :],
                    mask=head_ok[:, None] & (cols < dim_idx)[None, :], other=0.0)
    w = tl.load(w_ptr + row * heads_idx + heads, mask=head_ok, other=0.0).to(tl.float32)
    k_idx_batch = k_idx_ptr + batch * num_keys * dim_idx
    num_visible = tl.minimum(query + offset + 1, num_keys)
    first = 0
    if HAS_FIRST_KEY:  # packed sequences: keys before the query's own sequence are never candidates
        first = tl.load(first_key_ptr + row).to(tl.int32)

    best = tl.full([KP], _EMPTY_KEY, tl.int64)
    pieces = tl.arange(0, KP // SUB)
    for block_start in range(first, num_visible, KP):
        block = tl.full([KP // SUB, SUB], _EMPTY_KEY, tl.int64)
        for piece in range(KP // SUB):
            positions = block_start + piece * SUB + tl.arange(0, SUB)
            scores = _block_scores(q_idx, w, k_idx_batch, positions, num_visible, dim_idx, DI_PAD, DOT_PRECISION)
            keys = _pack(scores, positions, positions < num_visible)
            block = tl.where(pieces[:, None] == piece, keys[None, :], block)
        merged = tl.reshape(tl.join(best, tl.reshape(block, [KP])), [2 * KP])
        best = tl.topk(merged, KP)

    position = 0x7FFFFFFF - (best & 0x7FFFFFFF)
    slots = tl.arange(0, KP)
    tl.store(out_ptr + row * topk + slots, tl.where(best == _EMPTY_KEY, -1, position), mask=slots < topk)


@triton.jit
def _sparse_attention_kernel(q_ptr, k_ptr, v_ptr, indices_ptr, out_ptr, num_queries, num_keys, heads, heads_kv,
                             dim, dim_v, num_selected, scale,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    row, kv_head, head_block = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    batch = row // num_queries
    group = heads // heads_kv
    local = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # query heads of this key/value head
    head_ok = local < group
    q_heads = kv_head * group + local
    cd, cv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = tl.load(q_ptr + (row * heads + q_heads[:, None]) * dim + cd[None, :],
                mask=head_ok[:, None] & (cd < dim)[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], tl.float32)
    for n0 in range(0, num_selected, BLOCK_N):
        slot = n0 + tl.arange(0, BLOCK_N)
        position = tl.load(indices_ptr + row * num_selected + slot, mask=slot < num_selected, other=-1)
        picked = position >= 0
        kv_row = (batch * num_keys + tl.maximum(position, 0)) * heads_kv + kv_head
        keys = tl.load(k_ptr + kv_row[:, None] * dim + cd[None, :], mask=picked[:, None] & (cd < dim)[None, :],
                       other=0.0)
        values = tl.load(v_ptr + kv_row[:, None] * dim_v + cv[None, :],
                         mask=picked[:, None] & (cv < dim_v)[None, :], other=0.0)
        logits = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale  # [BLOCK_H, BLOCK_N] fp32
        logits = tl.where(picked[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing picked yet: avoid -inf - -inf
        p = tl.exp(logits - m_ref[:, None])
        rescale = tl.exp(m - m_ref)
        l = l * rescale + tl.sum(p, axis=1)
        acc = tl.dot(p.to(values.dtype), values, acc * rescale[:, None], input_precision=DOT_PRECISION)
        m = m_new

    out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + (row * heads + q_heads[:, None]) * dim_v + cv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (cv < dim_v)[None, :])


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get true fp32 dots; 16-bit inputs use the tensor cores with fp32 accumulation."""
    return "ieee" if dtype == torch.float32 else "tf32"


def index_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, k: int, offset: int = 0,
               first_key: torch.Tensor | None = None) -> torch.Tensor:
    """select_topk(index_scores(q_idx, k_idx, w), k, offset) without the [B, T, S] scores.

    q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI]; first_key: [B, T] int64 or None (the earliest
    key each query may see) -> [B, T, k] int64, -1 pads.
    """
    reject_interpreted_bf16(q_idx=q_idx)
    batch, num_queries, heads_idx, dim_idx = q_idx.shape
    num_keys = k_idx.shape[1]
    out = torch.empty(batch, num_queries, k, dtype=torch.int64, device=q_idx.device)
    if out.numel() == 0:
        return out
    kp = max(16, triton.next_power_of_2(k))  # at least 16: SUB <= KP is a tl.dot dimension
    k_idx = k_idx.to(q_idx.dtype)
    _index_topk_kernel[(num_queries, batch)](
        q_idx.contiguous(), k_idx.contiguous(), w.contiguous(), out if first_key is None else first_key.contiguous(),
        out, num_queries, num_keys, heads_idx, dim_idx, k, offset, KP=kp, SUB=min(kp, 128),
        HI_PAD=max(16, triton.next_power_of_2(heads_idx)), DI_PAD=max(16, triton.next_power_of_2(dim_idx)),
        HAS_FIRST_KEY=first_key is not None, DOT_PRECISION=_precision(q_idx.dtype), num_warps=8)
    return out


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Softmax attention over the selected positions; the contract of `latentmoe_lab.ops.sparse_attention`.

    q: [B, T, H, D]; k: [B, S, HKV, D]; v: [B, S, HKV, DV]; indices: [B, T, kk] (-1 = none)
    -> [B, T, H, DV] in q's dtype.
    """
    reject_interpreted_bf16(q=q)
    batch, num_queries, heads, dim = q.shape
    num_keys, heads_kv, dim_v = k.shape[1], k.shape[2], v.shape[3]
    scale = dim ** -0.5 if scale is None else float(scale)
    out = torch.empty(batch, num_queries, heads, dim_v, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    group = heads // heads_kv
    d_pad, dv_pad = max(16, triton.next_power_of_2(dim)), max(16, triton.next_power_of_2(dim_v))
    # The fp32 accumulator is [BLOCK_H, DV_PAD]: fewer heads per program when values are wide (MLA: 512).
    block_h = max(16, min(64, triton.next_power_of_2(group), 8192 // dv_pad))
    grid = (batch * num_queries, heads_kv, triton.cdiv(group, block_h))
    _sparse_attention_kernel[grid](
        q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(), indices.contiguous().long(), out,
        num_queries, num_keys, heads, heads_kv, dim, dim_v, indices.shape[-1], scale,
        BLOCK_H=block_h, BLOCK_N=16, D_PAD=d_pad, DV_PAD=dv_pad, DOT_PRECISION=_precision(q.dtype))
    return out
