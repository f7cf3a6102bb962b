"""Kimi Delta Attention (docs/design.md §1.3): the per-token recurrence and its chunked WY / UT form.

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

g is a log-space decay (g <= 0). The chunked form never takes exp() of a positive number:
each decay is a product of exp(g_t) factors (ops/kda_intra.py), which keeps fp32's relative
precision however deep the decay, and g = -1000 gives exact zeros, never inf or NaN, in the
outputs and in the gradients (those of the products are taken in log space, ops/kda_intra.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from latentmoe_lab.ops.backend import resolve_backend
from latentmoe_lab.ops.kda_intra import chunk_decays_and_scores
from latentmoe_lab.ops.kda_state import chunk_states

# Token-heads per group of chunks in kda_chunked: 8192 x 64 fp32 channels = 2 MiB per intermediate, so a
# group's working set stays in cache (larger groups stream DRAM; smaller ones pay more Python per token).
GROUP_ROWS = 8192


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
    state = _start_state(initial_state, batch, heads, dim_k, dim_v, q.device, torch.float32)
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
    which leaves the state untouched. Chunks run in groups of about GROUP_ROWS token-heads, so memory
    is O(GROUP_ROWS K) beyond the inputs and output, at any T (intra-chunk math: ops/kda_intra.py).
    backend (see ops.backend): the "triton" kernel rounds chunk_size to a power of two in [16, 128].
    Math is fp32, or fp64 when any input is fp64 (so torch.autograd.gradcheck can check the backward);
    the final state comes back in that dtype.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    scale = _validate(q, k, v, g, beta, scale, initial_state)
    if resolve_backend(backend, q, k, v, g, beta, initial_state) == "triton":
        from latentmoe_kernels.kda import kda_chunked as kda_chunked_triton
        return kda_chunked_triton(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    return run_chunk_groups(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, _chunk_group)


def run_chunk_groups(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, chunk_size: int,
                     run_group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group loop of `kda_chunked` on validated inputs; `run_group` is `_chunk_group` or a compiled twin of it."""
    batch, seq_len, heads, dim_k = q.shape
    dim_v, out_dtype = v.shape[-1], v.dtype
    named = (q, k, v, g, beta) if initial_state is None else (q, k, v, g, beta, initial_state)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in named) else torch.float32
    state = _start_state(initial_state, batch, heads, dim_k, dim_v, q.device, dtype)
    if seq_len == 0:
        return v.new_zeros(batch, 0, heads, dim_v), state if output_final_state else None

    # Groups of whole chunks, about GROUP_ROWS token-heads each; the state carries from group to group.
    state = rearrange(state, "b h k v -> (b h) k v")
    group = max(1, GROUP_ROWS // (batch * heads * chunk_size)) * chunk_size
    outputs = []
    for first in range(0, seq_len, group):
        pieces = (t[:, first:first + group] for t in (q, k, v, g, beta))
        out, state = run_group(*pieces, state, scale, chunk_size)
        outputs.append(out)
    out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    state = rearrange(state, "(b h) k v -> b h k v", b=batch)
    return out.to(out_dtype), state if output_final_state else None


def _chunk_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over one group of whole chunks: [B, T_g, H, d] inputs, state [B*H, K, V] -> ([B, T_g, H, V] fp32, state).

    Inside the group the layout is chunk-major, [N, B*H, C, d], so each slice the state loop takes is contiguous.
    The math runs in the state's dtype (fp32, or fp64).
    """
    batch, seq_len = q.shape[:2]
    num_chunks = math.ceil(seq_len / chunk_size)
    pad = num_chunks * chunk_size - seq_len
    q, k, v, g, beta = (
        rearrange(F.pad(t.to(state.dtype), (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t.to(state.dtype),
                  "b (n c) h ... -> n (b h) c ...", c=chunk_size).contiguous()
        for t in (q, k, v, g, beta)
    )
    decays, attn_qk, attn_kk = chunk_decays_and_scores(q, k, beta, g)  # [N, BH, C, C]; Aqk without the scale

    # (I + diag(beta) A)^-1 diag(beta) once per chunk (A's unit diagonal is implied), then W and U.
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    # (contiguous: LAPACK's batched solve takes twice as long on the strided view)
    solve = torch.linalg.solve_triangular(attn_kk.contiguous(), eye.expand_as(attn_kk), upper=False,
                                          unitriangular=True)
    solve = solve * beta[..., None, :]
    w = solve @ (decays.from_start * k)  # exp(Gamma) * K through the solve
    u = solve @ v

    k_to_end = (decays.to_end * k).transpose(-1, -2)  # [N, BH, K, C]: exp(Gamma_C - Gamma_j) k_j
    # V' = U - W S and S <- exp(Gamma_C) S + k_to_end V', chunk by chunk (ops/kda_state.py):
    # chunk_starts [N, BH, K, V], writes [N, BH, C, V]
    chunk_starts, writes, state = chunk_states(w, u, k_to_end, decays.whole_chunk, state)

    # O = scale ((Q * exp(Gamma)) S + Aqk V'): the scale rides on baddbmm's two factors, not on a pass over Q
    out = torch.baddbmm(((q * decays.from_start) @ chunk_starts).flatten(0, 1), attn_qk.flatten(0, 1),
                        writes.flatten(0, 1), beta=scale, alpha=scale).unflatten(0, (num_chunks, -1))
    return rearrange(out, "n (b h) c v -> b (n c) h v", b=batch)[:, :seq_len], state


def _start_state(
    initial_state: torch.Tensor | None, batch: int, heads: int, dim_k: int, dim_v: int, device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The state [B, H, K, V] in dtype (fp32 or fp64) the recurrence starts from (zeros when none is given)."""
    if initial_state is None:
        return torch.zeros(batch, heads, dim_k, dim_v, dtype=dtype, device=device)
    return initial_state.to(dtype)


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
    check_float_tensors(named, "q")

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

    return resolve_scale(scale, dim_k)


def check_float_tensors(named: dict, reference: str) -> None:
    """Every value a floating-point torch.Tensor on the device of named[reference] (errors name the argument)."""
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {tensor.dtype}")
    device = named[reference].device
    for name, tensor in named.items():
        if tensor.device != device:
            raise ValueError(f"{name}: expected device {device} (that of {reference}), got {tensor.device}")


def resolve_scale(scale: float | None, dim_k: int) -> float:
    """The query scale: K ** -0.5 by default, else a finite positive number (ValueError naming `scale`)."""
    if scale is None:
        return dim_k ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite positive number or None, got {scale!r}")
    return float(scale)
