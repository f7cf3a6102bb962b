"""One KDA decode step for many sequences, advancing a state the caller owns in place (docs/design.md §1.3, §6.4).

The serving decode step is memory-bound: per layer it streams the [S, H, d_k, d_v] fp32 state, and
`kda_recurrent` on [S, 1] allocates a new state-sized tensor at every stage (decay, outer product, sum)
on top of the caller's copies. Per head, with d = exp(g) per key channel, this step runs the same
recurrence (ops/kda.py) as four passes over the state and no state-sized allocation:

    S.mul_(d)                                  # S' = d * S, in place
    write = beta (v - k^T S')                  # one [BH, 1, K] x [BH, K, V] product
    S.baddbmm_(k, write^T)                     # S_new = S' + k write^T, in place
    o = scale q^T S_new                        # one more product

The same ops in the same order as `kda_recurrent`, so the results are the reference's to the bit on CPU:
bf16 models keep paged == contiguous parity (tests/test_paged_forward.py). Sharing one [BH, 2, K] product
for k^T S' and q^T S (o = (scale q * d)^T S + scale (q . k) write, three passes) was slower on CPU
(7.5 ms against 5.9 ms at 32 x 4 x 128 x 128, one thread: a two-row batched GEMM does not stream at the
one-row speed) and rounds differently, which flipped bf16 ulps in that parity test.
Its plain twin is `kda_recurrent` with T = 1 (tests/test_ops_kda_decode.py).
"""
from __future__ import annotations

import torch

from latentmoe_lab.ops.kda import check_float_tensors, resolve_scale

_STATE_DTYPES = (torch.float32, torch.float64)


def kda_decode_step_(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Advance state [B, H, K, V] (fp32 or fp64, contiguous) by one token per row, in place; return o [B, H, V].

    q, k: [B, H, K] (k L2-normalised, as the layer gives it); v: [B, H, V]; g: [B, H, K] log decay (<= 0);
    beta: [B, H]; scale defaults to K ** -0.5 and multiplies q. The math runs in state's dtype (fp64 inputs
    need an fp64 state); o comes back in v's dtype. Forward-only: the in-place update has no backward.
    Only `state` is written; the other tensors are read.
    """
    scale = _validate(state, q, k, v, g, beta, scale)
    batch, heads, dim_k, dim_v = state.shape
    rows, out_dtype = batch * heads, v.dtype
    q, k, v, g, beta = (t.to(state.dtype) for t in (q, k, v, g, beta))
    keys = k.reshape(rows, dim_k, 1)
    flat = state.view(rows, dim_k, dim_v)
    flat.mul_(g.exp().reshape(rows, dim_k, 1))
    predicted = torch.bmm(keys.transpose(1, 2), flat)  # [BH, 1, V]: k^T S'
    write = beta.reshape(rows, 1, 1) * (v.reshape(rows, 1, dim_v) - predicted)
    flat.baddbmm_(keys, write)
    out = torch.bmm((q * scale).reshape(rows, 1, dim_k), flat)  # o sees its own write
    return out.view(batch, heads, dim_v).to(out_dtype)


def _validate(state, q, k, v, g, beta, scale) -> float:
    """Check types, shapes, dtypes and devices; return the scale to use."""
    named = {"state": state, "q": q, "k": k, "v": v, "g": g, "beta": beta}
    check_float_tensors(named, "state")
    if state.dim() != 4:
        raise ValueError(f"state: expected 4 dims [B, H, K, V], got shape {tuple(state.shape)}")
    if state.dtype not in _STATE_DTYPES:
        raise ValueError(f"state: expected float32 or float64 (the math runs in state's dtype), got {state.dtype}")
    if not state.is_contiguous():
        raise ValueError("state: expected a contiguous tensor (it is updated in place through a [B*H, K, V] view)")
    if state.dtype != torch.float64 and any(t.dtype == torch.float64 for t in named.values()):
        raise ValueError(f"state: fp64 inputs need an fp64 state (the math runs in state's dtype), got {state.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in named.values()):
        raise ValueError("state: kda_decode_step_ updates in place and has no backward; call it under "
                         "torch.no_grad() or use kda_recurrent where gradients are needed")

    batch, heads, dim_k, dim_v = state.shape
    expected = {"q": (batch, heads, dim_k), "k": (batch, heads, dim_k), "g": (batch, heads, dim_k),
                "v": (batch, heads, dim_v), "beta": (batch, heads)}
    layouts = {"q": "[B, H, K]", "k": "[B, H, K]", "g": "[B, H, K]", "v": "[B, H, V]", "beta": "[B, H]"}
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {layouts[name]} = {shape} (from state [B, H, K, V] = "
                             f"{tuple(state.shape)}), got {tuple(named[name].shape)}")

    return resolve_scale(scale, dim_k)
