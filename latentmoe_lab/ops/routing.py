"""Top-k routing, expert-major permutation and grouped matmul (docs/design.md §1.2).

Shape legend: N tokens, E experts, K experts per token, D feature width,
M = N * K permuted rows (one per (token, selected expert) pair).

    s      = sigmoid(logits)                     fp32, [N, E]
    choice = s + bias                            bias picks experts, never weighs them
    I      = TopK(choice, K)                     optionally inside the topk_group best groups
    w_i    = s_i / sum_{j in I} s_j * scaling

Dispatch is a stable sort of the flattened expert indices: rows of one expert
become contiguous, so every expert runs one dense matmul over its slice.

Ops with a Triton kernel take backend="auto" | "torch" | "triton" (see ops.backend):
route_topk, route_and_plan (routing and dispatch plan in one kernel pass), grouped_matmul,
grouped_swiglu (SwiGLU fused into the first expert GEMM) and combine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentmoe_lab.ops import batch_invariant
from latentmoe_lab.ops.activations import sigmoid, silu, situ
from latentmoe_lab.ops.backend import resolve_backend

# 0/0 guard: sigmoid underflows to exactly 0 for logits below about -104.
_MIN_SCORE_SUM = 1e-20
# Permuted rows per step of the row-wise work on CPU (combine, LatentExperts): 4096 x 256 fp32 is 4 MiB, so
# the intermediates stay in cache and below glibc's 32 MiB mmap limit, past which every allocation of a
# whole-batch intermediate is fresh pages (page faults cost more than the arithmetic here). GPUs take all rows.
CPU_TILE_ROWS = 4096


def _check_routing_args(logits, top_k, bias, n_group, topk_group) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected 2 dims [N, E], got shape {shape}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be an integer in [1, E={num_experts}], got {top_k!r}")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group: must be a positive integer dividing E={num_experts}, got {n_group!r}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: must be an integer in [1, n_group={n_group}], got {topk_group!r}")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError(f"n_group: needs >= 2 experts per group (group score = top-2 sum), got {per_group}")
    if top_k > topk_group * per_group:
        raise ValueError(f"top_k: ({top_k}) exceeds the experts in the kept groups "
                         f"(topk_group {topk_group} x {per_group} experts per group)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts,):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias: expected shape ({num_experts},) [E], got {shape}")
        if not bias.is_floating_point():
            raise TypeError(f"bias: expected a floating dtype, got {bias.dtype}")
    # A data-dependent branch, which would split a compiled graph. Under torch.compile (the compiled training
    # step, compiled.py) it is redundant: NaN logits make the loss non-finite, and the training loop then replays
    # the step eagerly under the NonFiniteGuard, which runs this check and names the layer.
    if not torch.compiler.is_compiling() and torch.isnan(logits).any():
        raise ValueError("logits: contains NaN")


def _normalise(selected_scores: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    if renormalize:
        selected_scores = selected_scores / selected_scores.sum(-1, keepdim=True).clamp_min(_MIN_SCORE_SUM)
    return selected_scores * scaling


def route_topk(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, n_group: int = 1,
               topk_group: int = 1, renormalize: bool = True, scaling: float = 1.0, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing. logits [N, E] -> (weights [N, top_k] fp32, indices [N, top_k] int64).

    bias [E] shifts the selection only. With n_group > 1 the experts split into
    n_group contiguous groups; a group scores the sum of its top-2 biased scores
    and only the topk_group best groups stay eligible.
    """
    _check_routing_args(logits, top_k, bias, n_group, topk_group)
    if resolve_backend(backend, logits, bias) == "triton":
        from latentmoe_kernels.routing import fused_route
        routed = fused_route(logits, top_k, bias, n_group, topk_group, renormalize, scaling)
        return routed.weights, routed.indices
    scores = sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.unflatten(-1, (n_group, -1))  # [N, G, E/G]
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(-1, group_score.topk(topk_group, dim=-1).indices, True)
        # -inf, not 0: biased scores may be negative and must still beat a dropped group.
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)
    indices = choice.topk(top_k, dim=-1).indices
    return _normalise(scores.gather(-1, indices), renormalize, scaling), indices


def route_topk_reference(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, n_group: int = 1,
                         topk_group: int = 1, renormalize: bool = True, scaling: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `route_topk`, one token at a time with explicit sorts (ties broken by lower index)."""
    _check_routing_args(logits, top_k, bias, n_group, topk_group)
    num_experts = logits.shape[1]
    per_group = num_experts // n_group
    weights, indices = [], []
    for row in logits.float():
        s = sigmoid(row)
        choice = (s if bias is None else s + bias.float()).tolist()
        eligible = range(num_experts)
        if n_group > 1:
            def group_score(g):
                return sum(sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)[:2])
            groups = sorted(range(n_group), key=lambda g: (-group_score(g), g))[:topk_group]
            eligible = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(eligible, key=lambda e: (-choice[e], e))[:top_k]
        indices.append(chosen)
        weights.append(s[chosen])
    weights = torch.stack(weights) if weights else logits.new_zeros(0, top_k, dtype=torch.float32)
    return (_normalise(weights, renormalize, scaling),
            torch.tensor(indices, dtype=torch.int64, device=logits.device).reshape(-1, top_k))


@dataclass(frozen=True)
class DispatchPlan:
    """Where each (token, slot) pair sits once rows are sorted expert-major.

    order:       [M] int64, flat (token * K + slot) position of each permuted row
    token_index: [M] int64, token each permuted row comes from (order // K)
    counts:      [E] int64, rows per expert
    offsets:     [E] int64, end offset of each expert's rows (cumsum of counts)
    """

    order: torch.Tensor
    token_index: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    top_k: int


def check_expert_indices(indices: torch.Tensor, num_experts: int, dims: int, layout: str) -> None:
    """Raise unless indices is an integer tensor with `dims` dims (named `layout`) and values in [0, num_experts)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != dims:
        shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices: expected {dims} dims {layout}, got shape {shape}")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"indices: expected an integer dtype, got {indices.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: must be a positive integer, got {num_experts!r}")
    # Under torch.compile the range check (two host syncs) is skipped: there indices come from a topk over E
    # columns (LatentMoE.forward), in range by construction; every eager call still checks.
    if indices.numel() and not torch.compiler.is_compiling() and (
            int(indices.min()) < 0 or int(indices.max()) >= num_experts):
        raise ValueError(f"indices: values must lie in [0, num_experts={num_experts}), "
                         f"got range [{int(indices.min())}, {int(indices.max())}]")


def count_routed(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed pairs per expert: indices (any shape, values in [0, E)) -> [E] int64.

    bincount's output length depends on the largest index (a data-dependent shape that splits a compiled
    graph); a scatter-add into E zeros has a static shape and the same exact integer counts.
    """
    flat = indices.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def plan_dispatch(indices: torch.Tensor, num_experts: int) -> DispatchPlan:
    """indices [N, K] int64 -> DispatchPlan; inside one expert the rows keep token order."""
    check_expert_indices(indices, num_experts, 2, "[N, K]")
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = count_routed(flat, num_experts)
    return DispatchPlan(order=order, token_index=order // indices.shape[1], counts=counts,
                        offsets=counts.cumsum(0), top_k=indices.shape[1])


def route_and_plan(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, n_group: int = 1,
                   topk_group: int = 1, renormalize: bool = True, scaling: float = 1.0, backend: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """`route_topk` then `plan_dispatch`: logits [N, E] -> (weights [N, K] fp32, indices [N, K], DispatchPlan).

    With backend "triton" one kernel pass over the logits yields all three (latentmoe_kernels.routing).
    """
    _check_routing_args(logits, top_k, bias, n_group, topk_group)
    if resolve_backend(backend, logits, bias) == "torch":
        weights, indices = route_topk(logits, top_k, bias, n_group, topk_group, renormalize, scaling, backend="torch")
        return weights, indices, plan_dispatch(indices, logits.shape[1])
    from latentmoe_kernels.routing import fused_route
    routed = fused_route(logits, top_k, bias, n_group, topk_group, renormalize, scaling)
    plan = DispatchPlan(order=routed.order, token_index=routed.order // top_k, counts=routed.counts,
                        offsets=routed.offsets, top_k=top_k)
    return routed.weights, routed.indices, plan


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x [N, D] -> [N*K, D], one copy of each token per selected expert, expert-major."""
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims [N, D], got shape {tuple(x.shape)}")
    if x.shape[0] * plan.top_k != plan.order.numel():
        raise ValueError(f"x: has {x.shape[0]} rows but the plan was built for "
                         f"{plan.order.numel() // plan.top_k} tokens")
    return x[plan.token_index]


def combine(y: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan, num_tokens: int,
            backend: str = "auto") -> torch.Tensor:
    """sum_k weights[n, k] * y[row of (n, k)] -> [num_tokens, D] fp32. y: [N*K, D], weights: [N, K]."""
    rows = plan.order.numel()
    if y.dim() != 2 or y.shape[0] != rows:
        raise ValueError(f"y: expected shape [{rows}, D] (one row per routed pair), got {tuple(y.shape)}")
    if weights.numel() != rows or weights.dim() != 2 or weights.shape[1] != plan.top_k:
        raise ValueError(f"weights: expected shape [N, {plan.top_k}] with N*K = {rows}, got {tuple(weights.shape)}")
    if num_tokens != weights.shape[0]:
        raise ValueError(f"num_tokens: must equal weights.shape[0] ({weights.shape[0]}), got {num_tokens!r}")
    if resolve_backend(backend, y, weights) == "triton":
        from latentmoe_kernels.grouped_gemm import combine as combine_triton
        return combine_triton(y, weights, plan.order)
    row_weight = weights.float().reshape(-1)[plan.order].unsqueeze(-1)
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for start, stop in row_tiles(rows, y.device):
        out.index_add_(0, plan.token_index[start:stop], y[start:stop].float() * row_weight[start:stop])
    return out


def row_tiles(rows: int, device: torch.device) -> list[tuple[int, int]]:
    """(start, stop) ranges covering `rows`: CPU_TILE_ROWS at a time on CPU, all at once elsewhere.

    Always at least one range ((0, 0) for no rows), so a caller's per-tile work runs once.
    """
    step = CPU_TILE_ROWS if device.type == "cpu" else max(rows, 1)
    return [(start, min(start + step, rows)) for start in range(0, max(rows, 1), step)]


def check_grouped_args(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims [M, D_in], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[0] < 1 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected shape [E >= 1, D_in={x.shape[1]}, D_out], got {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"w: dtype {w.dtype} must match x dtype {x.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0]:
        raise ValueError(f"offsets: expected shape ({w.shape[0]},) [E], got {tuple(offsets.shape)}")
    if offsets.is_floating_point() or offsets.dtype == torch.bool:
        raise TypeError(f"offsets: expected an integer dtype, got {offsets.dtype}")
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    if bool((counts < 0).any()) or int(offsets[-1]) != x.shape[0]:
        raise ValueError(f"offsets: must be non-decreasing end offsets ending at M={x.shape[0]}, "
                         f"got {offsets.tolist()}")


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm as verified here: CPU, fp32/bf16/fp16, 16-byte strides, no autograd (CPU backward fails)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    aligned = all(dim * x.element_size() % 16 == 0 for dim in (w.shape[1], w.shape[2]))
    return (x.device.type == "cpu" and not needs_grad and aligned
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and hasattr(torch, "_grouped_mm"))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, impl: str = "auto",
                   backend: str = "auto") -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x [M, D_in] times w[e] [D_in, D_out] -> [M, D_out].

    impl (torch backend only): "auto" | "grouped_mm" (torch._grouped_mm, one fused call) | "padded"
    (always valid). "auto" takes grouped_mm when `_grouped_mm_fits`, else "padded".
    backend "triton" runs latentmoe_kernels.grouped_gemm (fp32 accumulation).
    """
    if impl not in ("auto", "grouped_mm", "padded"):
        raise ValueError(f"impl: must be 'auto', 'grouped_mm' or 'padded', got {impl!r}")
    check_grouped_args(x, w, offsets)
    if resolve_backend(backend, x, w) == "triton":
        from latentmoe_kernels.grouped_gemm import grouped_gemm
        return grouped_gemm(x, w, offsets)
    fits = _grouped_mm_fits(x, w)
    if impl == "grouped_mm" and not fits:
        raise ValueError("impl: 'grouped_mm' needs CPU fp32/bf16/fp16 tensors, D_in and D_out rows of a "
                         "multiple of 16 bytes, and no autograd")
    # No shortcut for M == 0: every path returns [0, D_out] in the autograd graph of x and w (w's gradient is
    # zero), as the reference does. An expert-parallel rank that receives no rows must still run the backward
    # of its All-to-Alls, which only happens while its expert output stays in the graph.
    if impl == "grouped_mm" or (impl == "auto" and fits):
        if batch_invariant.active():
            return _grouped_mm_min_rows(x, w, offsets.long())
        return torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offsets.to(torch.int32))
    return _grouped_matmul_padded(x, w, offsets.long())


def _grouped_mm_min_rows(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm with every non-empty group padded to batch_invariant.MIN_ROWS rows, so a row's bits do
    not depend on how many tokens its expert got in this step (ops/batch_invariant.py says why)."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded_counts = torch.where(counts > 0, counts.clamp(min=batch_invariant.MIN_ROWS), 0)
    expert_of_row = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), counts, output_size=x.shape[0])
    row_in_group = torch.arange(x.shape[0], device=x.device) - (offsets - counts)[expert_of_row]
    padded_offsets = padded_counts.cumsum(0)
    destination = (padded_offsets - padded_counts)[expert_of_row] + row_in_group
    padded = x.new_zeros(int(padded_offsets[-1]), x.shape[1]).index_copy_(0, destination, x)
    return torch._grouped_mm(padded, w.contiguous(), offs=padded_offsets.to(torch.int32))[destination]


def _grouped_matmul_padded(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Scatter rows into [E, max_count, D_in], one batched matmul, gather the valid rows back.

    Trade-off: memory and FLOPs scale with E * max_count, so a skewed load pays for
    padding; the alternative, gathering a weight matrix per row, costs
    M * D_in * D_out memory, which is far worse for real expert sizes. Autograd
    flows through index_put, bmm and indexing.
    """
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    num_experts, rows = w.shape[0], x.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts, output_size=rows)
    slot_of_row = torch.arange(rows, device=x.device) - (offsets - counts)[expert_of_row]
    padded = x.new_zeros(num_experts, int(counts.max()), x.shape[1])
    padded = padded.index_put((expert_of_row, slot_of_row), x)
    return torch.bmm(padded, w)[expert_of_row, slot_of_row]


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a bound c, act(min(gate, c)) * clamp(up, -c, c) (docs/design.md §1.2).

    The bound acts on both inputs of the product, not on the product: a large up can no longer
    multiply a large gate, and the gate keeps its smooth negative side. Shared and routed experts use it.
    """
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    return silu(gate) * up


def expert_glu(gate: torch.Tensor, up: torch.Tensor, clamp: float | None = None,
               situ_betas: tuple[float, float] | None = None) -> torch.Tensor:
    """The experts' activation: `swiglu(gate, up, clamp)`, or with situ_betas = (beta_gate, beta_up)
    `ops.activations.situ` (K3, docs/design.md §18; no clamp: SiTU bounds both factors itself)."""
    if situ_betas is None:
        return swiglu(gate, up, clamp)
    if clamp is not None:
        raise ValueError(f"clamp: must be None with situ_betas (SiTU bounds its factors itself), got {clamp!r}")
    return situ(gate, up, *situ_betas)


def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, offsets: torch.Tensor, clamp: float | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """The experts' first GEMM and activation: silu(x_e @ gate_e) * (x_e @ up_e) -> [M, F] in x's dtype.

    x: [M, D] expert-major rows; w13: [E, D, 2F] (gate | up columns); offsets: [E] end offsets.
    clamp: optional bound c, as in `swiglu`: min(gate, c), clamp(up, -c, c). backend "triton" fuses the
    activation into the grouped GEMM, so the [M, 2F] pre-activation is never stored.
    """
    check_grouped_args(x, w13, offsets)
    if w13.shape[2] % 2:
        raise ValueError(f"w13: last dim must be even (gate | up halves), got shape {tuple(w13.shape)}")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0):
        raise ValueError(f"clamp: must be a positive number or None, got {clamp!r}")
    if resolve_backend(backend, x, w13) == "triton":
        from latentmoe_kernels.grouped_gemm import grouped_swiglu as grouped_swiglu_triton
        return grouped_swiglu_triton(x, w13, offsets, clamp)
    gate, up = grouped_matmul(x, w13, offsets).chunk(2, dim=-1)
    return swiglu(gate, up, clamp)


def grouped_matmul_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Twin of `grouped_matmul`: one plain matmul per expert slice."""
    check_grouped_args(x, w, offsets)
    starts = [0] + offsets.tolist()[:-1]
    return torch.cat([x[start:end] @ w[e] for e, (start, end) in enumerate(zip(starts, offsets.tolist()))])
