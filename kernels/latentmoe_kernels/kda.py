"""Kimi Delta Attention kernels: a chunked forward and a recurrent (decode) step.

Math (docs/design.md §1.3), per head, state S [K, V] fp32: S' = exp(g_t) * S (row-wise), S = S' + beta_t k_t
(v_t - S'^T k_t)^T, o_t = S^T (scale q_t). Inside a chunk of C tokens, with Gamma = cumsum(g):

    A[i, j]   = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd)     j < i
    Aqk[i, j] = sum_d q_id k_jd exp(Gamma_id - Gamma_jd)            j <= i   (q already scaled)
    T = (I + A)^-1,  W = T diag(beta) (exp(Gamma) * K),  U = T diag(beta) V
    V' = U - W S;  O = (Q * exp(Gamma)) S + Aqk V';  S <- exp(Gamma_C) S + (exp(Gamma_C - Gamma) * K)^T V'

Blocking of the chunked forward, two kernels:
1. `_kda_intra_chunk_kernel`, one program per (chunk, batch * head), all chunks in parallel. It holds
   the chunk's Q, K, g as [C, BK] tiles (BK = K padded), builds A and Aqk one key row j at a time,
   inverts I + A by forward substitution (row i of the inverse needs rows < i only) and writes W, U
   (fp32, in blocks of BV value columns) and Aqk for the second kernel.
2. `_kda_state_kernel`, one program per (value block, batch * head), walks the chunks in order with
   its [BK, BV] slice of S in registers: the delta rule acts on each value column separately, so
   value blocks never talk to each other. Everything in it is a matrix product.
Decays: exp() only ever sees a sum of g over a range of tokens (<= 0). The gaps Gamma_i - Gamma_j
are summed directly (a masked cumsum from row j), never formed as exp(Gamma_i) * exp(-Gamma_j),
which overflows for g = -1000; exact zeros come out instead of inf or NaN.

The recurrent kernel is the decode path: one program per (value block, batch * head) loops over the
(usually single) token(s) and writes the state back into the same buffer, in place.
All arithmetic is fp32 (dots with input_precision="ieee"), whatever the storage dtype. At C = 64 and
K = 128 every [C, BK] tile is 8k fp32 values, hence 8 warps for the chunked kernels. A tuned kernel
would also split the intra-chunk work into 16-row sub-blocks and use tensor cores; this one favours
the plain statement of the math.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, bh, t, cols, seq_len, heads, width):
    """Rows t of a [B, T, H, width] tensor for (b, h) = divmod(bh, heads) as fp32; zeros past T / width."""
    b, h = bh // heads, bh % heads
    at = ((b * seq_len + t[:, None]) * heads + h) * width + cols[None, :]
    return tl.load(ptr + at, mask=(t < seq_len)[:, None] & (cols < width)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _kda_intra_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, aqk_ptr,
                            seq_len, heads, dim_k, dim_v, scale,
                            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: B * T * H * K can pass 2**31
    rows = tl.arange(0, C)
    t = chunk * C + rows
    t_ok = t < seq_len
    ck = tl.arange(0, BK)
    q = _load_rows(q_ptr, bh, t, ck, seq_len, heads, dim_k) * scale
    k = _load_rows(k_ptr, bh, t, ck, seq_len, heads, dim_k)
    g = _load_rows(g_ptr, bh, t, ck, seq_len, heads, dim_k)  # padded tail rows: g = 0, k = 0, beta = 0
    beta = tl.load(beta_ptr + (bh // heads * seq_len + t) * heads + bh % heads, mask=t_ok, other=0.0).to(tl.float32)

    # Column j of A and Aqk: decay[i, d] = exp(sum of g over (j, i]) for i >= j, else 0.
    a_kk = tl.zeros([C, C], tl.float32)
    a_qk = tl.zeros([C, C], tl.float32)
    for j in range(C):
        k_j = tl.sum(tl.where(rows[:, None] == j, k, 0.0), axis=0)  # [BK]
        gap = tl.cumsum(tl.where(rows[:, None] > j, g, 0.0), axis=0)
        k_j_decayed = tl.where(rows[:, None] >= j, tl.exp(gap), 0.0) * k_j[None, :]
        column = rows[None, :] == j
        a_qk = tl.where(column, tl.sum(q * k_j_decayed, axis=1)[:, None], a_qk)
        a_kk = tl.where(column & (rows[:, None] > j), tl.sum(k * k_j_decayed, axis=1)[:, None], a_kk)
    a_kk = beta[:, None] * a_kk

    # Forward substitution: row i of (I + A)^-1 is e_i - sum_{j<i} A[i, j] * row j.
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_row = tl.sum(tl.where(rows[:, None] == i, a_kk, 0.0), axis=0)  # [C], zero from column i on
        new_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, axis=0)
        inverse = tl.where(rows[:, None] == i, new_row[None, :], inverse)

    b, h = bh // heads, bh % heads
    gamma = tl.cumsum(g, axis=0)
    w = tl.dot(inverse, beta[:, None] * tl.exp(gamma) * k, input_precision="ieee")
    at_k = ((b * seq_len + t[:, None]) * heads + h) * dim_k + ck[None, :]
    tl.store(w_ptr + at_k, w, mask=t_ok[:, None] & (ck < dim_k)[None, :])
    for v0 in range(0, dim_v, BV):
        cv = v0 + tl.arange(0, BV)
        v = _load_rows(v_ptr, bh, t, cv, seq_len, heads, dim_v)
        u = tl.dot(inverse, beta[:, None] * v, input_precision="ieee")
        at_v = ((b * seq_len + t[:, None]) * heads + h) * dim_v + cv[None, :]
        tl.store(u_ptr + at_v, u, mask=t_ok[:, None] & (cv < dim_v)[None, :])
    tl.store(aqk_ptr + (bh * seq_len + t[:, None]) * C + rows[None, :], a_qk, mask=t_ok[:, None])


@triton.jit
def _kda_state_kernel(q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, aqk_ptr, o_ptr, state_in_ptr, state_out_ptr,
                      seq_len, heads, dim_k, dim_v, scale,
                      HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    block_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = block_v * BV + tl.arange(0, BV)
    state_at = bh * dim_k * dim_v + ck[:, None] * dim_v + cv[None, :]
    state_ok = (ck < dim_k)[:, None] & (cv < dim_v)[None, :]
    state = tl.zeros([BK, BV], tl.float32)
    if HAS_INITIAL:
        state = tl.load(state_in_ptr + state_at, mask=state_ok, other=0.0)

    for start in range(0, seq_len, C):
        t = start + rows
        t_ok = t < seq_len
        q = _load_rows(q_ptr, bh, t, ck, seq_len, heads, dim_k) * scale
        k = _load_rows(k_ptr, bh, t, ck, seq_len, heads, dim_k)
        g = _load_rows(g_ptr, bh, t, ck, seq_len, heads, dim_k)
        w = _load_rows(w_ptr, bh, t, ck, seq_len, heads, dim_k)
        u = _load_rows(u_ptr, bh, t, cv, seq_len, heads, dim_v)
        a_qk = tl.load(aqk_ptr + (bh * seq_len + t[:, None]) * C + rows[None, :], mask=t_ok[:, None], other=0.0)
        gamma = tl.cumsum(g, axis=0)  # decay from the chunk start through row i
        to_end = tl.cumsum(g, axis=0, reverse=True) - g  # decay after row i to the chunk end

        new_v = u - tl.dot(w, state, input_precision="ieee")  # V' = U - W S
        out = tl.dot(q * tl.exp(gamma), state, input_precision="ieee")
        out = tl.dot(a_qk, new_v, out, input_precision="ieee")
        out_at = ((b * seq_len + t[:, None]) * heads + h) * dim_v + cv[None, :]
        tl.store(o_ptr + out_at, out.to(o_ptr.dtype.element_ty), mask=t_ok[:, None] & (cv < dim_v)[None, :])

        chunk_decay = tl.exp(tl.sum(g, axis=0))  # [BK]
        state = tl.dot(tl.trans(tl.exp(to_end) * k), new_v, chunk_decay[:, None] * state, input_precision="ieee")

    if STORE_FINAL:
        tl.store(state_out_ptr + state_at, state, mask=state_ok)


@triton.jit
def _kda_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr,
                          seq_len, heads, dim_k, dim_v, scale, BK: tl.constexpr, BV: tl.constexpr):
    block_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    ck = tl.arange(0, BK)
    cv = block_v * BV + tl.arange(0, BV)
    k_ok, v_ok = ck < dim_k, cv < dim_v
    state_at = bh * dim_k * dim_v + ck[:, None] * dim_v + cv[None, :]
    state = tl.load(state_ptr + state_at, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    for t in range(seq_len):
        row = (b * seq_len + t) * heads + h
        q = tl.load(q_ptr + row * dim_k + ck, mask=k_ok, other=0.0).to(tl.float32) * scale
        k = tl.load(k_ptr + row * dim_k + ck, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * dim_k + ck, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * dim_v + cv, mask=v_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)
        state = tl.exp(g)[:, None] * state
        write = beta * (v - tl.sum(k[:, None] * state, axis=0))  # beta (v - S'^T k), [BV]
        state += k[:, None] * write[None, :]
        out = tl.sum(q[:, None] * state, axis=0)
        tl.store(o_ptr + row * dim_v + cv, out.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(state_ptr + state_at, state, mask=k_ok[:, None] & v_ok[None, :])


def _blocks(dim_k: int, dim_v: int) -> tuple[int, int]:
    """BK covers all of K (the delta rule sums over it); V is split into blocks of up to 32 columns."""
    return max(16, triton.next_power_of_2(dim_k)), min(32, max(16, triton.next_power_of_2(dim_v)))


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float | None = None, initial_state: torch.Tensor | None = None,
                output_final_state: bool = False, chunk_size: int = 64
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, the contract of `latentmoe_lab.ops.kda_chunked` (the caller validates shapes).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V].
    The chunk length C of the kernel is chunk_size rounded up to a power of two in [16, 128] (tl.dot
    tiles); the result does not depend on the chunk length.
    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None).
    """
    chunk_size = min(128, max(16, triton.next_power_of_2(chunk_size)))
    batch, seq_len, heads, dim_k = q.shape
    dim_v = v.shape[-1]
    scale = dim_k ** -0.5 if scale is None else float(scale)
    block_k, block_v = _blocks(dim_k, dim_v)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    device = q.device
    out = torch.empty(batch, seq_len, heads, dim_v, dtype=v.dtype, device=device)
    final = torch.empty(batch, heads, dim_k, dim_v, dtype=torch.float32, device=device)
    if seq_len == 0:
        final = torch.zeros_like(final) if initial_state is None else initial_state.float().clone()
        return out, final if output_final_state else None

    w = torch.empty(batch, seq_len, heads, dim_k, dtype=torch.float32, device=device)
    u = torch.empty(batch, seq_len, heads, dim_v, dtype=torch.float32, device=device)
    a_qk = torch.empty(batch, heads, seq_len, chunk_size, dtype=torch.float32, device=device)
    _kda_intra_chunk_kernel[(triton.cdiv(seq_len, chunk_size), batch * heads)](
        q, k, v, g, beta, w, u, a_qk, seq_len, heads, dim_k, dim_v, scale, C=chunk_size, BK=block_k, BV=block_v,
        num_warps=8)
    state_in = final if initial_state is None else initial_state.float().contiguous()
    _kda_state_kernel[(triton.cdiv(dim_v, block_v), batch * heads)](
        q, k, g, w, u, a_qk, out, state_in, final, seq_len, heads, dim_k, dim_v, scale,
        HAS_INITIAL=initial_state is not None, STORE_FINAL=output_final_state, C=chunk_size, BK=block_k,
        BV=block_v, num_warps=8)
    return out, final if output_final_state else None


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA (the decode step), the contract of `latentmoe_lab.ops.kda_recurrent`.

    An fp32, contiguous initial_state [B, H, K, V] is advanced in place, so a cache's state tensor
    needs no copy per decoded token; any other initial_state is copied to fp32 first.
    Returns (o [B, T, H, V] in v's dtype, the final state [B, H, K, V] fp32 or None).
    """
    batch, seq_len, heads, dim_k = q.shape
    dim_v = v.shape[-1]
    scale = dim_k ** -0.5 if scale is None else float(scale)
    block_k, block_v = _blocks(dim_k, dim_v)
    if initial_state is None:
        state = torch.zeros(batch, heads, dim_k, dim_v, dtype=torch.float32, device=q.device)
    elif initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        state = initial_state
    else:
        state = initial_state.float().contiguous()
    out = torch.empty(batch, seq_len, heads, dim_v, dtype=v.dtype, device=q.device)
    _kda_recurrent_kernel[(triton.cdiv(dim_v, block_v), batch * heads)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), out, state,
        seq_len, heads, dim_k, dim_v, scale, BK=block_k, BV=block_v)
    return out, state if output_final_state else None
