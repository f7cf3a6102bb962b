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

g is a log-space decay (g <= 0). Every exp() argument is then <= 0: the pairwise
gaps Gamma_i - Gamma_j are taken only for j <= i (masked before exp), so g = -1000
gives exact zeros, never inf or NaN.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA, one token at a time, all math in fp32.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay; beta: [B, T, H];
    initial_state: [B, H, K, V]; scale defaults to K ** -0.5 and multiplies q.
    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None).
    """
    scale = _validate(q, k, v, g, beta, scale, initial_state)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (WY / UT transform), same contract as `kda_recurrent` plus `chunk_size`.

    Intra-chunk work is batched over B, H and all chunks; only the state hand-off
    loops, once per chunk. Any T: the tail is padded with g = 0, beta = 0, k = 0,
    which leaves the state untouched. Memory is O(B H T C K) for the pairwise decays.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    scale = _validate(q, k, v, g, beta, scale, initial_state)
    batch, seq_len, heads, dim_k = q.shape
    dim_v, out_dtype = v.shape[-1], v.dtype
    state = _start_state(initial_state, batch, heads, dim_k, dim_v, q.device)
    if seq_len == 0:
        return v.new_zeros(batch, 0, heads, dim_v), state if output_final_state else None

    num_chunks = math.ceil(seq_len / chunk_size)
    pad = num_chunks * chunk_size - seq_len
    q, k, v, g = (
        rearrange(F.pad(t.float(), (0, 0, 0, 0, 0, pad)), "b (n c) h d -> b h n c d", c=chunk_size)
        for t in (q, k, v, g)
    )
    beta = rearrange(F.pad(beta.float(), (0, 0, 0, pad)), "b (n c) h -> b h n c", c=chunk_size)
    q = q * scale
    gamma = g.cumsum(dim=-2)  # [B, H, N, C, K], non-increasing along C

    # Gamma_i - Gamma_j = sum of g over (j, i]. Summing those terms directly instead of subtracting
    # two cumsums keeps small gaps exact in fp32 after a huge decay (g = -1000 makes Gamma ~ -1000).
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strictly_below = causal.tril(diagonal=-1)[..., None]  # [C(i), C(j), 1]
    gap_terms = g[..., :, None, :].expand(*g.shape[:-1], chunk_size, dim_k).masked_fill(~strictly_below, 0.0)
    pair_gap = gap_terms.cumsum(dim=-3)  # [B, H, N, C(i), C(j), K]
    # exp only where j <= i (argument <= 0); the masked upper triangle becomes exactly 0.
    pair_decay = pair_gap.masked_fill(~causal[..., None], float("-inf")).exp()
    attn_qk = einsum(q, k, pair_decay, "... i d, ... j d, ... i j d -> ... i j")
    attn_kk = einsum(k, k, pair_decay, "... i d, ... j d, ... i j d -> ... i j")
    attn_kk = beta[..., :, None] * attn_kk.tril(diagonal=-1)

    # One triangular solve gives both W and U: (I + A) [W | U] = diag(beta) [exp(Gamma) * K | V].
    eye = torch.eye(chunk_size, device=q.device)
    rhs = beta[..., None] * torch.cat([gamma.exp() * k, v], dim=-1)
    w, u = torch.linalg.solve_triangular(eye + attn_kk, rhs, upper=False, unitriangular=True).split(
        [dim_k, dim_v], dim=-1
    )

    chunk_decay = gamma[..., -1, :].exp()  # [B, H, N, K]
    k_to_end = pair_decay[..., -1, :, :] * k  # keys decayed to the chunk end: exp(Gamma_C - Gamma_j)
    chunk_starts, writes = [], []
    for n in range(num_chunks):
        chunk_starts.append(state)
        write = u[:, :, n] - w[:, :, n] @ state  # V' = U - W S
        writes.append(write)
        state = chunk_decay[:, :, n, :, None] * state + k_to_end[:, :, n].transpose(-1, -2) @ write
    chunk_starts = torch.stack(chunk_starts, dim=2)  # [B, H, N, K, V]
    writes = torch.stack(writes, dim=2)  # [B, H, N, C, V]

    out = (q * gamma.exp()) @ chunk_starts + attn_qk @ writes
    out = rearrange(out, "b h n c v -> b (n c) h v")[:, :seq_len]
    return out.to(out_dtype), state if output_final_state else None


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
