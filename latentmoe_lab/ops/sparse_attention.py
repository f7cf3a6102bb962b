"""DeepSeek Sparse Attention reference ops (docs/design.md §1.4): indexer scores, causal top-k, sparse attention.

    I[t, s]  = sum_j w[t, j] * ReLU(q_idx[t, j] . k_idx[s])       index_scores
    S_t      = TopK_{s <= t + offset} I[t, s]   (-1 pads)          select_topk
    o[t, h]  = sum_{s in S_t} softmax_s(scale * q[t, h] . k[s]) v[s]   sparse_attention

`index_topk` is select_topk(index_scores(...)) in one call; with backend="triton" (see ops.backend) it
never holds the [B, T, S] scores. `sparse_attention` takes a backend too.

Shapes: B batch, T queries in this chunk, S keys (cached + new), H query heads, HKV key/value heads
(HKV divides H; HKV = 1 is the absorbed-MLA MQA form), D query/key dim, DV value dim, HI/DI indexer
heads/dim. `offset` is the number of cached tokens before this chunk, so query t sits at position t + offset.
Scores and softmax run in fp32 whatever the storage dtype.
"""
from __future__ import annotations

import torch
from einops import einsum, rearrange

from latentmoe_lab.ops.backend import resolve_backend


def index_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores, no masking.

    q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI]  ->  [B, T, S] fp32 (fp64 stays fp64).
    """
    _check_index_inputs(q_idx, k_idx, w)
    dtype = _compute_dtype(q_idx)
    # Keys-major product: the key cache is read once, row by row (faster for a decode query on CPU).
    per_head = einsum(k_idx.to(dtype), q_idx.to(dtype), "b s d, b t j d -> b s t j").relu()
    return einsum(per_head, w.to(dtype), "b s t j, b t j -> b t s")


def select_topk(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """Causal top-k positions per query. scores: [B, T, S]  ->  [B, T, k] int64.

    Query t may see keys s <= t + offset. Rows with fewer than k visible keys keep them all and pad
    with -1; visible positions always come before the padding. Equal scores go to the earlier position.
    """
    ranked, num_visible = _rank_causally(scores, k, offset)
    kept = min(k, ranked.shape[-1])
    if kept == 0:  # no keys at all: every slot is padding
        return torch.full((*ranked.shape[:2], k), -1, dtype=torch.long, device=ranked.device)
    # The kept-th best score is the threshold: everything above it is in, and of the scores equal
    # to it the earliest positions fill the remaining slots. torch.topk is O(S) per query, a sort
    # O(S log S); the rule is the stable sort's, so every call selects what select_topk_reference does.
    threshold = ranked.topk(kept, dim=-1).values[..., -1:]
    above = ranked > threshold
    tied = ranked == threshold
    room = kept - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= room))  # exactly `kept` per row
    positions = chosen.nonzero()[:, -1].view(*ranked.shape[:2], kept)  # ascending in each row
    best_first = ranked.gather(-1, positions).sort(dim=-1, descending=True, stable=True).indices
    return _pad_selection(positions.gather(-1, best_first), num_visible, k)


def select_topk_reference(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """select_topk by one stable sort of every row (the reference twin; O(S log S) per query)."""
    ranked, num_visible = _rank_causally(scores, k, offset)
    # A stable sort breaks ties (ReLU makes exact-zero scores common) towards the earlier position,
    # so a chunked or cached call selects exactly what one full-sequence call selects.
    top = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, T, min(k, S)]
    return _pad_selection(top, num_visible, k)


def _rank_causally(scores: torch.Tensor, k: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check select_topk's arguments; return (scores with invisible keys at -inf, visible keys per query [T, 1])."""
    _check_floating("scores", scores, 3, "[B, T, S]")
    _check_int("k", k, minimum=1)
    _check_int("offset", offset, minimum=0)
    _, num_queries, num_keys = scores.shape
    device = scores.device
    query_pos = torch.arange(num_queries, device=device)[:, None] + offset
    visible = torch.arange(num_keys, device=device)[None, :] <= query_pos  # [T, S]
    # Clamping keeps a visible -inf score strictly above the masked positions.
    floor = torch.finfo(scores.dtype).min
    ranked = torch.where(visible, scores.clamp(min=floor), float("-inf"))
    return ranked, (query_pos + 1).clamp(max=num_keys)


def _pad_selection(top: torch.Tensor, num_visible: torch.Tensor, k: int) -> torch.Tensor:
    """top: [B, T, min(k, S)] positions, best first -> [B, T, k], slots past the visible keys set to -1."""
    slot = torch.arange(top.shape[-1], device=top.device)[None, :]
    top = torch.where(slot < num_visible, top, -1)
    if k > top.shape[-1]:
        top = torch.cat([top, top.new_full((*top.shape[:2], k - top.shape[-1]), -1)], dim=-1)
    return top


def index_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, k: int, offset: int = 0,
               first_key: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """select_topk(index_scores(q_idx, k_idx, w), k, offset): the indexer's causal top-k in one step.

    q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI]  ->  [B, T, k] int64, -1 pads.
    first_key [B, T] int64 (packed sequences): the earliest key each query may see; keys before it are
    never selected, exactly as if the query's own sequence ran alone (its positions unchanged).
    """
    _check_index_inputs(q_idx, k_idx, w)
    _check_int("k", k, minimum=1)
    _check_int("offset", offset, minimum=0)
    if first_key is not None and (not isinstance(first_key, torch.Tensor) or first_key.dtype != torch.int64
                                  or first_key.shape != q_idx.shape[:2]):
        got = f"{first_key.dtype} {tuple(first_key.shape)}" if isinstance(first_key, torch.Tensor) else \
            type(first_key).__name__
        raise ValueError(f"first_key: expected an int64 tensor of shape [B, T] = {tuple(q_idx.shape[:2])}, got {got}")
    if resolve_backend(backend, q_idx, k_idx, w) == "triton":
        from latentmoe_kernels.sparse_attention import index_topk as index_topk_triton
        return index_topk_triton(q_idx, k_idx, w, k, offset, first_key)
    scores = index_scores(q_idx, k_idx, w)
    if first_key is None:
        return select_topk(scores, k, offset)
    # Earlier sequences' keys rank below every real score, so the top-k takes the query's own sequence
    # first, in the order it would alone; then they become padding.
    earlier = torch.arange(scores.shape[-1], device=scores.device) < first_key[..., None]
    positions = select_topk(scores.masked_fill(earlier, float("-inf")), k, offset)
    return positions.masked_fill(positions < first_key[..., None], -1)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention over the selected key positions only; index -1 is masked.

    q: [B, T, H, D]; k: [B, S, HKV, D]; v: [B, S, HKV, DV]; indices: [B, T, kk] int (shared by all heads)
    ->  [B, T, H, DV] in q's dtype. A query with no selected position returns 0. scale defaults to D**-0.5.
    """
    _check_qkv(q, k, v)
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"indices: expected an integer dtype, got {indices.dtype}")
    if indices.dim() != 3:
        raise ValueError(f"indices: expected 3 dims [B, T, kk], got shape {tuple(indices.shape)}")
    if indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"indices: leading dims [B, T] must be {tuple(q.shape[:2])} like q, "
                         f"got {tuple(indices.shape[:2])}")
    if indices.shape[-1] < 1:
        raise ValueError("indices: needs at least one position per query (kk >= 1)")
    num_keys = k.shape[1]
    if indices.numel() and (indices.min() < -1 or indices.max() >= num_keys):
        raise ValueError(f"indices: values must lie in [-1, S-1] = [-1, {num_keys - 1}], "
                         f"got range [{int(indices.min())}, {int(indices.max())}]")
    scale = _default_scale(scale, q)
    if resolve_backend(backend, q, k, v) == "triton":
        from latentmoe_kernels.sparse_attention import sparse_attention as sparse_attention_triton
        return sparse_attention_triton(q, k, v, indices, scale)
    dtype = _compute_dtype(q)
    heads_kv = k.shape[2]

    selected = indices >= 0  # [B, T, kk]
    gather_at = indices.clamp(min=0).long()
    k_sel = _gather_rows(k, gather_at).to(dtype)  # [B, T, kk, HKV, D]
    if _leading_channels_of(v, k):  # absorbed MLA: V = the latent part of K, so one gather serves both
        v_sel = k_sel[..., :v.shape[-1]]
    else:
        v_sel = _gather_rows(v, gather_at).to(dtype)  # [B, T, kk, HKV, DV]

    q_grouped = rearrange(q.to(dtype), "b t (g r) d -> b t g r d", g=heads_kv)
    logits = einsum(q_grouped, k_sel, "b t g r d, b t n g d -> b t g r n") * scale
    probs = _masked_softmax(logits, selected[:, :, None, None, :])
    out = einsum(probs, v_sel, "b t g r n, b t n g e -> b t g r e")
    return rearrange(out, "b t g r e -> b t (g r) e").to(q.dtype)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                           offset: int = 0) -> torch.Tensor:
    """Plain masked-softmax attention, query t seeing keys s <= t + offset (the reference for sparse_attention).

    q: [B, T, H, D]; k: [B, S, HKV, D]; v: [B, S, HKV, DV]  ->  [B, T, H, DV] in q's dtype.
    """
    _check_qkv(q, k, v)
    _check_int("offset", offset, minimum=0)
    scale = _default_scale(scale, q)
    dtype = _compute_dtype(q)
    num_queries, num_keys = q.shape[1], k.shape[1]
    query_pos = torch.arange(num_queries, device=q.device)[:, None] + offset
    visible = torch.arange(num_keys, device=q.device)[None, :] <= query_pos  # [T, S]

    q_grouped = rearrange(q.to(dtype), "b t (g r) d -> b g r t d", g=k.shape[2])
    logits = einsum(q_grouped, k.to(dtype), "b g r t d, b s g d -> b g r t s") * scale
    probs = _masked_softmax(logits, visible)
    out = einsum(probs, v.to(dtype), "b g r t s, b s g e -> b t g r e")
    return rearrange(out, "b t g r e -> b t (g r) e").to(q.dtype)


# ------------------------------------------------------------------------------------------ helpers
def _leading_channels_of(v: torch.Tensor, k: torch.Tensor) -> bool:
    """True when v is k[..., :DV]: the same memory, strides and leading dims, fewer channels."""
    return (v.data_ptr() == k.data_ptr() and v.shape[:-1] == k.shape[:-1] and v.stride() == k.stride()
            and v.shape[-1] <= k.shape[-1] and v.dtype == k.dtype)


def _gather_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x: [B, S, ...], positions: [B, T, kk] in [0, S)  ->  [B, T, kk, ...].

    index_select copies whole rows, several times faster on CPU than advanced indexing, which
    computes an offset per element. One call per batch row keeps cache views (strided over B) uncopied.
    """
    rows = [x[b].index_select(0, positions[b].flatten()) for b in range(x.shape[0])]
    gathered = rows[0][None] if len(rows) == 1 else torch.stack(rows)  # stack would copy a lone row block
    return gathered.view(*positions.shape, *x.shape[2:])


def _masked_softmax(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to `keep`; rows with nothing kept become all zeros, not NaN."""
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return probs.masked_fill(~keep, 0.0)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for every low-precision input; fp64 stays fp64 so tests can compare exactly."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _default_scale(scale: float | None, q: torch.Tensor) -> float:
    if scale is None:
        return q.shape[-1] ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale: must be a positive number or None, got {scale!r}")
    return float(scale)


def _check_index_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor) -> None:
    _check_floating("q_idx", q_idx, 4, "[B, T, HI, DI]")
    _check_floating("k_idx", k_idx, 3, "[B, S, DI]")
    _check_floating("w", w, 3, "[B, T, HI]")
    _check_same_batch(("q_idx", q_idx), ("k_idx", k_idx), ("w", w))
    if k_idx.shape[-1] != q_idx.shape[-1]:
        raise ValueError(f"k_idx: last dim (DI={k_idx.shape[-1]}) must match q_idx's DI={q_idx.shape[-1]}")
    if w.shape[1:] != q_idx.shape[1:3]:
        raise ValueError(f"w: expected shape [B, T, HI] = {tuple(q_idx.shape[:3])} to match q_idx, "
                         f"got {tuple(w.shape)}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check_floating("q", q, 4, "[B, T, H, D]")
    _check_floating("k", k, 4, "[B, S, HKV, D]")
    _check_floating("v", v, 4, "[B, S, HKV, DV]")
    _check_same_batch(("q", q), ("k", k), ("v", v))
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: last dim (D={k.shape[-1]}) must match q's D={q.shape[-1]}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v: dims [S, HKV] must be {tuple(k.shape[1:3])} like k, got {tuple(v.shape[1:3])}")
    heads, heads_kv = q.shape[2], k.shape[2]
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k: key/value heads (HKV={heads_kv}) must divide q's heads (H={heads})")


def _check_floating(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {layout}, got shape {tuple(x.shape)}")


def _check_same_batch(*named: tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, x in named[1:]:
        if x.shape[0] != first.shape[0]:
            raise ValueError(f"{name}: batch size {x.shape[0]} must match {first_name}'s {first.shape[0]}")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
