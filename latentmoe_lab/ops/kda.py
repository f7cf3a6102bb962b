"""Kimi Delta Attention (DESIGN 1.3): the per-token recurrence and its chunked WY / UT form.

Per head the state S is [K, V] fp32 and every token t does

    S' = exp(g_t)[:, None] * S                    # per-key-channel decay
    S  = S' + beta_t k_t (v_t - S'^T k_t)^T       # delta rule
    o_t = S^T (scale q_t)

`kda_recurrent` runs exactly that, one token at a time (the reference).
`kda_chunked` gives the same outputs and final state with matrix products inside
chunks of C tokens and a loop over chunks only. Inside a chunk, with S the state
at its start and Gamma = cumsum(g):

    A[i, j]   = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd)       j < i
    Aqk[i, j] = sum_d q_id k_jd exp(Gamma_id - Gamma_jd)              j <= i
    W = (I + A)^-1 diag(beta) (exp(Gamma) * K),  U = (I + A)^-1 diag(beta) V
    V' = U - W S                          # the delta-rule writes u_t, all at once
    O  = (Q * exp(Gamma)) S + Aqk V'      # Aqk includes i = j: o_t sees its own write
    S <- exp(Gamma_C) S + (exp(Gamma_C - Gamma) * K)^T V'

Derivation: unrolling the recurrence from the chunk start gives
S_t = exp(Gamma_t) S + sum_{j<=t} exp(Gamma_t - Gamma_j) k_j u_j^T with
u_t = beta_t (v_t - (decayed S_{t-1})^T k_t); substituting S_{t-1} into u_t yields the
unit-lower-triangular system (I + A) U_true = diag(beta) (V - (exp(Gamma) * K) S).

g is a log-space decay (g <= 0). Every exp() argument is then <= 0: each decay is
exp(Gamma_later - Gamma_earlier) with the later position first (pairs j > i are masked
before exp), so g = -1000 gives exact zeros, never inf or NaN. Gamma is summed in fp64
so that those differences keep fp32 accuracy after such a reset.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from latentmoe_lab.ops.backend import resolve_backend


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA, one token at a time, all math in fp32.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay; beta: [B, T, H];
    initial_state: [B, H, K, V]; scale defaults to K ** -0.5 and multiplies q.
    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None).
    backend (see ops.backend): "triton" runs the decode kernel, which advances an fp32 contiguous
    initial_state in place (the cache's own tensor) instead of allocating a new state.
    """
    scale = _validate(q, k, v, g, beta, scale, initial_state)
    if resolve_backend(backend, q, k, v, g, beta, initial_state) == "triton":
        from latentmoe_kernels.kda import kda_recurrent as kda_recurrent_triton
        return kda_recurrent_triton(q, k, v, g, beta, scale, initial_state, output_final_state)
    batch, seq_len, heads, dim_k = q.shape
    dim_v, out_dtype = v.shape[-1], v.dtype
    state = _start_state(initial_state, batch, heads, dim_k, dim_v, q.device)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * scale

    outputs = []
    for t in range(seq_len):
        state = g[:, t].exp()[..., None] * state
        predicted = einsum(k[:, t], state, "b h k, b h k v -> b h v")
        write = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + einsum(k[:, t], write, "b h k, b h v -> b h k v")
        outputs.append(einsum(q[:, t], state, "b h k, b h k v -> b h v"))

    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(batch, 0, heads, dim_v)
    return out.to(out_dtype), state if output_final_state else None


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (WY / UT transform), same contract as `kda_recurrent` plus `chunk_size`.

    Intra-chunk work is batched over B, H and all chunks; only the state hand-off
    loops, once per chunk. Any T: the tail is padded with g = 0, beta = 0, k = 0,
    which leaves the state untouched. Memory is O(B H T (c + C/c) K) with sub-chunks of c ~ sqrt(C)
    tokens (see `_intra_chunk_scores`).
    backend (see ops.backend): the "triton" kernel rounds chunk_size to a power of two in [16, 128].
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    scale = _validate(q, k, v, g, beta, scale, initial_state)
    if resolve_backend(backend, q, k, v, g, beta, initial_state) == "triton":
        from latentmoe_kernels.kda import kda_chunked as kda_chunked_triton
        return kda_chunked_triton(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    batch, seq_len, heads, dim_k = q.shape
    dim_v, out_dtype = v.shape[-1], v.dtype
    state = _start_state(initial_state, batch, heads, dim_k, dim_v, q.device)
    if seq_len == 0:
        return v.new_zeros(batch, 0, heads, dim_v), state if output_final_state else None

    num_chunks = math.ceil(seq_len / chunk_size)
    pad = num_chunks * chunk_size - seq_len
    q, k, v = (
        rearrange(F.pad(t.float(), (0, 0, 0, 0, 0, pad)), "b (n c) h d -> b h n c d", c=chunk_size)
        for t in (q, k, v)
    )
    g = rearrange(F.pad(g.double(), (0, 0, 0, 0, 0, pad)), "b (n c) h d -> b h n c d", c=chunk_size)
    beta = rearrange(F.pad(beta.float(), (0, 0, 0, pad)), "b (n c) h -> b h n c", c=chunk_size)
    q = q * scale
    # fp64 cumsum: a difference Gamma_i - Gamma_j of two cumsums stays exact to fp32 even after a
    # g = -1000 reset has pushed both near -1000 (in fp32 it would lose ~6e-5). Only [B, H, N, C, K].
    gamma = g.cumsum(dim=-2)  # [B, H, N, C, K], non-increasing along C
    attn_qk, attn_kk = _intra_chunk_scores(q, k, gamma)
    attn_kk = beta[..., :, None] * attn_kk

    # One triangular solve gives both W and U: (I + A) [W | U] = diag(beta) [exp(Gamma) * K | V].
    decay = gamma.float().exp()  # exp(Gamma_i): from the chunk start to i
    eye = torch.eye(chunk_size, device=q.device)
    rhs = beta[..., None] * torch.cat([decay * k, v], dim=-1)
    w, u = torch.linalg.solve_triangular(eye + attn_kk, rhs, upper=False, unitriangular=True).split(
        [dim_k, dim_v], dim=-1
    )

    chunk_decay = decay[..., -1, :]  # [B, H, N, K]
    k_to_end = _decay(gamma[..., -1:, :], gamma) * k  # keys decayed to the chunk end: exp(Gamma_C - Gamma_j)
    chunk_starts, writes = [], []
    for n in range(num_chunks):
        chunk_starts.append(state)
        write = u[:, :, n] - w[:, :, n] @ state  # V' = U - W S
        writes.append(write)
        state = chunk_decay[:, :, n, :, None] * state + k_to_end[:, :, n].transpose(-1, -2) @ write
    chunk_starts = torch.stack(chunk_starts, dim=2)  # [B, H, N, K, V]
    writes = torch.stack(writes, dim=2)  # [B, H, N, C, V]

    out = (q * decay) @ chunk_starts + attn_qk @ writes
    out = rearrange(out, "b h n c v -> b (n c) h v")[:, :seq_len]
    return out.to(out_dtype), state if output_final_state else None


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk (j <= i) and the unscaled A (j < i) of every chunk at once, with exp() arguments <= 0.

    q, k: [..., C, K] fp32; gamma: [..., C, K] fp64 cumsum of g  ->  two [..., C, C] fp32 matrices.
    The chunk splits into sub-chunks of c tokens. Pairs inside one sub-chunk take the pairwise
    decay [c, c, K] directly. A pair (i in sub-chunk a, j in an earlier sub-chunk b) factors through
    the sub-chunk boundaries, every factor a decay <= 1:
        exp(Gamma_i - Gamma_j) = exp(Gamma_i - Gamma_start(a)) exp(Gamma_start(a) - Gamma_end(b))
                                 exp(Gamma_end(b) - Gamma_j)
    so those blocks are matrix products. Memory O(T (c + C/c) K) instead of O(T C K).
    """
    chunk = q.shape[-2]
    sub = _sub_chunk_size(chunk)
    num_sub = chunk // sub
    q_s, k_s, gamma_s = (rearrange(t, "... (a c) d -> ... a c d", c=sub) for t in (q, k, gamma))
    rows = torch.stack([q_s, k_s])  # [2, ..., S, c, K]: q for Aqk, k for A, against the same keys

    # Diagonal blocks. gamma = hi + lo in fp32: hi_i - hi_j is exact when the gap is small next to
    # Gamma (Sterbenz), lo restores the rest, so no fp64 [.., c, c, K] tensor is needed.
    hi = gamma_s.float()
    lo = (gamma_s - hi.double()).float()
    gap = hi[..., :, None, :] - hi[..., None, :, :]  # [..., S, c(i), c(j), K]
    gap.add_(lo[..., :, None, :]).sub_(lo[..., None, :, :])
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()[..., None]
    keys_decayed = gap.masked_fill_(~causal, float("-inf")).exp_() * k_s[..., None, :, :]
    diagonal = einsum(rows, keys_decayed, "x ... a i d, ... a i j d -> x ... a i j")
    if num_sub == 1:
        scores = diagonal[..., 0, :, :]
    else:
        end = gamma_s[..., -1, :]  # [..., S, K] Gamma at each sub-chunk's last token
        start = F.pad(end[..., :-1, :], (0, 0, 1, 0))  # Gamma just before each sub-chunk
        rows_from_start = rows * _decay(gamma_s, start[..., None, :])
        keys_to_end = k_s * _decay(end[..., None, :], gamma_s)
        sub_index = torch.arange(num_sub, device=q.device)
        earlier = (sub_index[None, :] < sub_index[:, None])[..., None]  # [S(a), S(b), 1]: b < a
        between = _decay(start[..., :, None, :], end[..., None, :, :], keep=earlier)  # [..., S(a), S(b), K]
        keys_across = between[..., None, :] * keys_to_end[..., None, :, :, :]  # [..., S(a), S(b), c(j), K]
        scores = einsum(rows_from_start, keys_across, "x ... a i d, ... a b j d -> x ... a i b j")
        on_diagonal = torch.eye(num_sub, dtype=q.dtype, device=q.device)
        scores = scores + einsum(diagonal, on_diagonal, "x ... a i j, a b -> x ... a i b j")
        scores = rearrange(scores, "x ... a i b j -> x ... (a i) (b j)")
    return scores[0], scores[1].tril(diagonal=-1)


def _decay(later: torch.Tensor, earlier: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(later - earlier) in fp32 for fp64 cumulative log decays, later at or after earlier (argument <= 0).

    Where `keep` is False the decay is 0, masked before exp so no inf appears, not even in the gradient.
    """
    gap = later - earlier
    if keep is not None:
        gap = gap.masked_fill(~keep, float("-inf"))
    return gap.float().exp()


def _sub_chunk_size(chunk_size: int) -> int:
    """The largest divisor of chunk_size not above sqrt(chunk_size): balances the c and C/c memory terms."""
    return max(d for d in range(1, math.isqrt(chunk_size) + 1) if chunk_size % d == 0)


def _start_state(
    initial_state: torch.Tensor | None, batch: int, heads: int, dim_k: int, dim_v: int, device: torch.device
) -> torch.Tensor:
    """The fp32 state [B, H, K, V] the recurrence starts from (zeros when none is given)."""
    if initial_state is None:
        return torch.zeros(batch, heads, dim_k, dim_v, dtype=torch.float32, device=device)
    return initial_state.float()


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
) -> float:
    """Check shapes, dtypes and devices; return the scale to use."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if initial_state is not None:
        named["initial_state"] = initial_state
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (that of q), got {tensor.device}")

    layouts = {"q": "[B, T, H, K]", "k": "[B, T, H, K]", "v": "[B, T, H, V]", "g": "[B, T, H, K]"}
    for name, layout in layouts.items():
        if named[name].dim() != 4:
            raise ValueError(f"{name}: expected 4 dims {layout}, got shape {tuple(named[name].shape)}")
    batch, seq_len, heads, dim_k = q.shape
    dim_v = v.shape[-1]
    for name in ("k", "g"):
        if named[name].shape != q.shape:
            raise ValueError(f"{name}: expected the shape of q {tuple(q.shape)} [B, T, H, K], "
                             f"got {tuple(named[name].shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v: expected [B, T, H] = {tuple(q.shape[:3])} as in q, got shape {tuple(v.shape)}")
    if dim_k < 1 or dim_v < 1:
        raise ValueError(f"q, v: head dims K and V must be >= 1, got K={dim_k}, V={dim_v}")
    if beta.shape != (batch, seq_len, heads):
        raise ValueError(f"beta: expected shape [B, T, H] = {(batch, seq_len, heads)}, got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (batch, heads, dim_k, dim_v):
        raise ValueError(f"initial_state: expected shape [B, H, K, V] = {(batch, heads, dim_k, dim_v)}, "
                         f"got {tuple(initial_state.shape)}")

    if scale is None:
        return dim_k ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite positive number or None, got {scale!r}")
    return float(scale)
