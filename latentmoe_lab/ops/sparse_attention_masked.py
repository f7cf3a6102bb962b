"""Sparse attention over selected keys as dense attention with a mask: the short-context form of
`ops.sparse_attention.sparse_attention` (its reference twin; tests/test_sparse_attention_masked.py compares them).

The gather form copies every selected key row per query, [B, T, kk, HKV, D], and its backward scatters the
gradients back row by row. While the keys are few (S within a small multiple of kk, as in training on
short rows) it is cheaper to score every key with one batched matrix product and let the selection act
as a bias on the logits:

    count[t, s] = how often s occurs in indices[t]       (0 for keys not selected, -1 pads ignored)
    o[t, h] = sum_s softmax_s(scale q[t, h] . k[s] + log count[t, s]) v[s]

log count is -inf for a key not selected and 0 for one selected once, so this is the gather form's softmax
over its kk slots, duplicates included (a key listed twice weighs twice there too). Only the order of the
sums differs, so outputs and gradients agree to rounding.

Shapes: B batch, T queries, S keys, H query heads, HKV key/value heads (dividing H), D key dim, DV value
dim, kk selected slots per query.
"""
from __future__ import annotations

import torch
from einops import einsum, rearrange

from latentmoe_lab.ops.sparse_attention import _check_qkv, _compute_dtype, _default_scale

# Use the masked form while S <= this many times kk: below it the batched products over all S keys
# cost less than gathering kk rows per query (benchmarks/RESULTS.md, issue 32: DSA at training shapes).
MASKED_KEYS_PER_SLOT = 4


def masked_form_pays(num_keys: int, slots: int) -> bool:
    """True when `masked_sparse_attention` is the cheaper form for S = num_keys keys and kk = slots."""
    return num_keys <= MASKED_KEYS_PER_SLOT * slots


def masked_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """Softmax attention over the selected key positions (index -1 is a pad), as a masked dense product.

    q: [B, T, H, D]; k: [B, S, HKV, D]; v: [B, S, HKV, DV]; indices: [B, T, kk] int in [-1, S)
    -> [B, T, H, DV] in q's dtype; a query with nothing selected returns 0. Same contract as sparse_attention.
    """
    _check_qkv(q, k, v)
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"indices: expected an integer dtype, got {indices.dtype}")
    if indices.dim() != 3 or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"indices: expected shape [B, T, kk] with [B, T] = {tuple(q.shape[:2])}, "
                         f"got {tuple(indices.shape)}")
    num_keys = k.shape[1]
    if indices.numel() and (indices.min() < -1 or indices.max() >= num_keys):
        raise ValueError(f"indices: values must lie in [-1, S-1] = [-1, {num_keys - 1}], "
                         f"got range [{int(indices.min())}, {int(indices.max())}]")
    scale = _default_scale(scale, q)
    dtype = _compute_dtype(q)

    # Pads land in an extra column S, dropped after counting.
    slots = torch.where(indices >= 0, indices, num_keys).long()
    count = torch.zeros(*indices.shape[:2], num_keys + 1, dtype=dtype, device=q.device)
    count = count.scatter_add_(-1, slots, torch.ones_like(slots, dtype=dtype))[..., :num_keys]  # [B, T, S]
    # A query with nothing selected gets a finite bias row (no 0/0 in its softmax) and a zero output below.
    selects = count.sum(dim=-1, keepdim=True) > 0  # [B, T, 1]
    bias = torch.where(count > 0, count.log(), torch.where(selects, float("-inf"), 0.0))[:, None, None]

    q_grouped = rearrange(q.to(dtype), "b t (g r) d -> b g r t d", g=k.shape[2])
    logits = einsum(q_grouped, k.to(dtype), "b g r t d, b s g d -> b g r t s") * scale + bias
    out = einsum(torch.softmax(logits, dim=-1), v.to(dtype), "b g r t s, b s g e -> b t g r e")
    out = out * selects[..., None, None]
    return rearrange(out, "b t g r e -> b t (g r) e").to(q.dtype)
