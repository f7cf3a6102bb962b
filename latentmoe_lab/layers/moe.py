"""Stable LatentMoE layer (docs/design.md §1.2).

    s, I, w = route(x)                          fp32 sigmoid router on the full-width x, bias for selection
    z       = W_down x                          tokens travel to experts in the latent size l < d
    y       = W_up RMSNorm_l( sum_{i in I} w_i Expert_i(z) ) + Shared(x)

The routed path runs in four separate steps so that expert parallelism can be
attached from outside by replacing `layer.dispatcher` (and `layer.experts` with
the local shard):

1. route      `layer.route(x [N, d]) -> (weights [N, K] fp32, indices [N, K] int64)`
2. dispatch   `dispatcher.dispatch(z [N, l], indices) -> (z_perm [M, l], counts [E_local] int64, ctx)`
              z_perm holds the rows this rank's experts must process, expert-major:
              rows counts[:e].sum() : counts[:e+1].sum() belong to local expert e.
3. experts    `layer.experts(z_perm, counts) -> y_perm [M, l]`
4. combine    `dispatcher.combine(y_perm, weights, ctx) -> [N, l] fp32`, the *complete*
              weighted sum over all K experts of each token (across ranks for an
              expert-parallel dispatcher), because RMSNorm_l of a partial sum is wrong.

`LocalDispatcher` is the single-device version built on `ops.routing`.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.ops import batch_invariant
from latentmoe_lab.ops.balancing import bias_update, quantile_bias, router_z_loss, sequence_aux_loss
from latentmoe_lab.ops.fused_glu import fused_glu
from latentmoe_lab.ops.grouped_experts import fits as grouped_experts_fit, grouped_swiglu_experts
from latentmoe_lab.ops.routed_experts import fused_routed_experts, on_torch_backend
from latentmoe_lab.ops.routing import (DispatchPlan, combine, count_routed, grouped_matmul, grouped_matmul_reference,
                                       permute, expert_glu, plan_dispatch, route_topk, route_topk_reference, row_tiles)


ROUTED_STRATEGIES = ("auto", "steps", "fused")  # LatentMoE.routed_strategy; LatentMoE.strategy picks for "auto"


class Dispatcher(Protocol):
    """Moves latent tokens to their experts and the weighted results back (steps 2 and 4 above)."""

    def dispatch(self, z: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_perm: torch.Tensor, weights: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts on this device: a stable sort by expert id, then a fp32 index_add back."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    @record_function("moe.dispatch")
    def dispatch(self, z: torch.Tensor, indices: torch.Tensor):
        plan = plan_dispatch(indices, self.num_experts)
        return permute(z, plan), plan.counts, (plan, z.shape[0])

    @record_function("moe.combine")
    def combine(self, y_perm: torch.Tensor, weights: torch.Tensor, ctx) -> torch.Tensor:
        plan, num_tokens = ctx
        return combine(y_perm, weights, plan, num_tokens)


def _glu(gate_up: torch.Tensor, clamp: float | None, situ_betas: tuple[float, float] | None = None) -> torch.Tensor:
    """[..., 2*inter] (gate | up) -> silu(gate) * up (with the optional clamp of `ops.routing.swiglu`), or SiTU
    with situ_betas (`ops.routing.expert_glu`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return expert_glu(gate, up, clamp, situ_betas)


class LatentExperts(nn.Module):
    """E SwiGLU experts in the latent width, stored stacked for grouped matmuls.

    w13: [E, latent, 2*inter] (gate | up), w2: [E, inter, latent]. situ_betas = (beta_gate, beta_up) makes
    them SiTU experts (moe.activation "situ", docs/design.md §18), on every path below.
    """

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int,
                 activation_clamp: float | None = None, situ_betas: tuple[float, float] | None = None):
        super().__init__()
        self.activation_clamp = activation_clamp
        self.situ_betas = situ_betas
        self.w13 = nn.Parameter(torch.empty(num_experts, latent_size, 2 * intermediate_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))

    @record_function("moe.experts")
    def forward(self, z_perm: torch.Tensor, counts: torch.Tensor,
                combine_with: tuple[torch.Tensor, DispatchPlan] | None = None) -> torch.Tensor:
        """z_perm [M, latent] expert-major, counts [E] rows per expert -> [M, latent].

        On CPU: torch._grouped_mm with a hand-written SwiGLU backward (ops.grouped_experts), except in
        batch-invariant mode, whose bits must not depend on the other rows' experts (`forward_tiles`).
        combine_with = (weights [N, K], plan): the "fused" strategy (`forward_fused`); z_perm is then the
        token-major z [N, latent] and the result the combined [N, latent] fp32 sum. Called as the module
        either way, so hooks on the experts (training's NonFiniteGuard) see both strategies.
        """
        if counts.dim() != 1 or counts.shape[0] != self.w13.shape[0]:
            raise ValueError(f"counts: expected shape ({self.w13.shape[0]},) [E], got {tuple(counts.shape)}")
        if combine_with is not None:
            return self.forward_fused(z_perm, *combine_with)
        if grouped_experts_fit(z_perm, self.w13, self.w2) and not batch_invariant.active():
            return grouped_swiglu_experts(z_perm, counts, self.w13, self.w2, self.activation_clamp, self.situ_betas)
        return self.forward_tiles(z_perm, counts)

    def forward_tiles(self, z_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`forward` through ops.routing's grouped matmul: z_perm [M, latent], counts [E] -> [M, latent].

        Triton on GPU; on CPU the batch-invariant path, in tiles of ops.routing.CPU_TILE_ROWS rows (an expert
        may span two tiles) so the [rows, 2 * inter] pre-activation stays in cache.
        """
        offsets = counts.cumsum(0)
        tiles = []
        for start, stop in row_tiles(z_perm.shape[0], z_perm.device):
            tile_offsets = (offsets - start).clamp(0, stop - start)  # each expert's rows inside the tile
            gate, up = grouped_matmul(z_perm[start:stop], self.w13, tile_offsets).chunk(2, dim=-1)
            hidden = fused_glu(gate, up, self.activation_clamp, self.situ_betas)  # one autograd node in training
            tiles.append(grouped_matmul(hidden, self.w2, tile_offsets))
        return torch.cat(tiles) if len(tiles) > 1 else tiles[0]

    def forward_fused(self, z: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The "fused" strategy: dispatch, experts and combine in one pass of tiles (ops.routed_experts).
        z [N, latent] token-major, weights [N, K], plan of `plan_dispatch` -> [N, latent] fp32, what
        `LocalDispatcher.combine(self(z_perm, counts), weights, ctx)` returns."""
        return fused_routed_experts(z, weights, plan, self.w13, self.w2, self.activation_clamp, self.situ_betas)

    def forward_reference(self, z_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Twin of `forward`: one plain matmul per expert slice (ops.routing.grouped_matmul_reference)."""
        offsets = counts.cumsum(0)
        hidden = _glu(grouped_matmul_reference(z_perm, self.w13, offsets), self.activation_clamp, self.situ_betas)
        return grouped_matmul_reference(hidden, self.w2, offsets)

    def expert_reference(self, z: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert_e(z) for one latent token z [latent] -> [latent], the textbook form."""
        return _glu(z @ self.w13[expert], self.activation_clamp, self.situ_betas) @ self.w2[expert]


class LatentMoE(nn.Module):
    """Stable LatentMoE. x [B, T, hidden] -> [B, T, hidden].

    After each forward: `last_expert_counts` [E], and `last_aux_loss` / `last_z_loss`, fp32 scalars
    already scaled by moe.aux_loss_alpha / moe.z_loss_coef (zero, without a graph, when a coefficient is 0).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        moe = config.moe
        self.hidden_size = config.hidden_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.routed_scaling = moe.routed_scaling_factor
        self.renormalize = moe.norm_topk_prob
        self.bias_update_rate = moe.bias_update_rate
        self.bias_rule = moe.bias_update  # "sign" (counts) or "quantile" (the batch's router scores)
        situ_betas = (moe.situ_beta_gate, moe.situ_beta_up) if moe.activation == "situ" else None
        self.aux_loss_alpha, self.z_loss_coef = moe.aux_loss_alpha, moe.z_loss_coef
        self.init_std = config.initializer_range

        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.register_buffer("correction_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        # moe.latent_projection False (docs/design.md §17): no down / latent norm / up, experts at the hidden width
        self.latent_size = moe.latent_size
        self.down = nn.Linear(config.hidden_size, moe.latent_size, bias=False) if moe.latent_projection else None
        self.experts = LatentExperts(moe.num_experts, moe.latent_size, moe.expert_intermediate_size,
                                     moe.activation_clamp, situ_betas)
        self.latent_norm = RMSNorm(moe.latent_size, eps=config.rms_norm_eps) if moe.latent_projection else None
        self.up = nn.Linear(moe.latent_size, config.hidden_size, bias=False) if moe.latent_projection else None
        # n shared experts of width inter sum to one SwiGLU of width n * inter.
        self.shared = (SwiGLU(config.hidden_size, moe.num_shared_experts * moe.expert_intermediate_size,
                              moe.activation_clamp, situ_betas) if moe.num_shared_experts else None)
        self.dispatcher: Dispatcher = LocalDispatcher(moe.num_experts)
        self.routed_strategy = "auto"  # one of ROUTED_STRATEGIES; `strategy` says which one a forward takes
        self.last_expert_counts = torch.zeros(moe.num_experts, dtype=torch.int64)
        # quantile rule only: the last forward's sigmoid router scores [N, E] fp32, detached (what update_bias reads)
        self.last_router_scores: torch.Tensor | None = None
        self.last_aux_loss = self.last_z_loss = torch.zeros(())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.init_std)
        nn.init.normal_(self.experts.w13, std=self.init_std)
        nn.init.normal_(self.experts.w2, std=self.init_std)
        if self.latent_norm is not None:
            nn.init.ones_(self.latent_norm.weight)
        self.correction_bias.zero_()

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        # Module.to(dtype) casts floating buffers too; the bias sums 1e-3 steps and must stay fp32.
        self.correction_bias = self.correction_bias.float()
        return self

    # ------------------------------------------------------------------ steps
    @record_function("moe.route")
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> fp32 logits [N, E], whatever the storage dtype."""
        return F.linear(x.float(), self.router.weight.float())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, K] fp32, indices [N, K] int64)."""
        return self.select_experts(self.router_logits(x))

    @record_function("moe.route")
    def select_experts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [N, E] -> (weights [N, K] fp32, indices [N, K] int64); the bias picks, never weighs."""
        return route_topk(logits, self.top_k, bias=self.correction_bias, n_group=self.n_group,
                          topk_group=self.topk_group, renormalize=self.renormalize, scaling=self.routed_scaling)

    def _record_router_losses(self, logits: torch.Tensor, indices: torch.Tensor, batch: int) -> None:
        """Scaled sequence-wise aux loss and z-loss of this forward; logits [N, E], indices [N, K]."""
        zero = logits.new_zeros(())
        self.last_aux_loss = zero if not self.aux_loss_alpha else sequence_aux_loss(
            rearrange(logits, "(b t) e -> b t e", b=batch), rearrange(indices, "(b t) k -> b t k", b=batch),
            self.aux_loss_alpha)
        self.last_z_loss = zero if not self.z_loss_coef else self.z_loss_coef * router_z_loss(logits)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected 3 dims [B, T, hidden={self.hidden_size}], got shape {shape}")
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating dtype, got {x.dtype}")

    def to_latent(self, x_nd: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> what the experts take [N, latent]: W_down x, or x itself without a latent projection."""
        return x_nd if self.down is None else self.down(x_nd)

    def _finish(self, mixed: torch.Tensor, x_nd: torch.Tensor, batch: int) -> torch.Tensor:
        """Latent RMSNorm on the complete fp32 expert sum [N, latent], up-projection, shared experts
        (without a latent projection the expert sum is the routed output as it is)."""
        out = mixed.to(x_nd.dtype) if self.up is None else self.up(self.latent_norm(mixed).to(x_nd.dtype))
        if self.shared is not None:
            with record_function("moe.shared"):
                out = out + self.shared(x_nd)
        return rearrange(out, "(b t) d -> b t d", b=batch)

    def strategy(self, z: torch.Tensor) -> str:
        """The routed path a forward on latent tokens z [N, latent] takes: "steps" (dispatcher.dispatch,
        experts, dispatcher.combine: the path expert parallelism, quantized experts, torch.compile and
        batch-invariant mode plug into) or "fused" (LatentExperts.forward_fused: one pass of tiles, no
        whole-batch [N*K, latent] tensors). `routed_strategy` "auto" takes "fused" wherever it applies: it is
        faster than "steps" at every size that matters, forward (no whole-batch gather, expert output and
        concatenation) and backward (no zero-filled slice gradients)."""
        if self.routed_strategy not in ROUTED_STRATEGIES:
            raise ValueError(f"routed_strategy: must be one of {ROUTED_STRATEGIES}, got {self.routed_strategy!r}")
        fused_applies = (type(self.dispatcher) is LocalDispatcher and type(self.experts) is LatentExperts
                         and z.device.type == "cpu" and not batch_invariant.active()
                         and not torch.compiler.is_compiling() and on_torch_backend(z))
        if self.routed_strategy == "fused" and not fused_applies:
            raise ValueError("routed_strategy: 'fused' needs the local dispatcher, LatentExperts, CPU tensors, the "
                             "torch backend, and neither torch.compile nor batch-invariant mode")
        return "fused" if self.routed_strategy != "steps" and fused_applies else "steps"

    def routed(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The complete routed sum before the latent norm: z [N, latent], weights [N, K] fp32, indices [N, K]
        -> [N, latent] fp32 = sum_k weights[n, k] Expert_{indices[n, k]}(z[n]), by `strategy`."""
        if self.strategy(z) == "fused":
            with record_function("moe.dispatch"):  # the plan is the whole dispatch here; tiles gather their rows
                plan = plan_dispatch(indices, self.num_experts)
            return self.experts(z, plan.counts, combine_with=(weights, plan))
        z_perm, counts, ctx = self.dispatcher.dispatch(z, indices)
        return self.dispatcher.combine(self.experts(z_perm, counts), weights, ctx)

    # --------------------------------------------------------------- forward
    @record_function("moe")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x_nd = rearrange(x, "b t d -> (b t) d")
        logits = self.router_logits(x_nd)
        weights, indices = self.select_experts(logits)
        self._record_router_losses(logits, indices, x.shape[0])
        if self.bias_rule == "quantile" and torch.is_grad_enabled():  # training forwards only: N x E floats
            self.last_router_scores = torch.sigmoid(logits.detach())
        mixed = self.routed(self.to_latent(x_nd), weights, indices)
        # Counted from the routing itself: an expert-parallel dispatcher only sees its local experts.
        self.last_expert_counts = count_routed(indices, self.num_experts).detach()
        return self._finish(mixed, x_nd, x.shape[0])

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Twin of `forward`: route each token alone, then loop over its selected experts."""
        self._check_input(x)
        x_nd = rearrange(x, "b t d -> (b t) d")
        weights, indices = route_topk_reference(
            self.router_logits(x_nd), self.top_k, bias=self.correction_bias, n_group=self.n_group,
            topk_group=self.topk_group, renormalize=self.renormalize, scaling=self.routed_scaling)
        rows = []
        for token, x_row in enumerate(x_nd):
            z = self.to_latent(x_row)
            acc = torch.zeros(z.shape[-1], dtype=torch.float32, device=x.device)
            for weight, expert in zip(weights[token], indices[token].tolist()):
                acc = acc + weight * self.experts.expert_reference(z, expert).float()
            rows.append(acc)
        mixed = torch.stack(rows) if rows else x_nd.new_zeros(0, self.latent_size, dtype=torch.float32)
        return self._finish(mixed, x_nd, x.shape[0])

    # -------------------------------------------------------------- balancing
    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing after a step, by moe.bias_update. counts: [E] tokens per expert.

        "sign": b <- b + u * sign(mean(c) - c). "quantile" (K3, docs/design.md §18): b <- `quantile_bias` of the
        last training forward's router scores (`last_router_scores`); the counts are still checked, not used.
        Data parallel: `target_bias` per rank, averaged, then `set_bias` (training/lm.py).
        """
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (self.num_experts,):
            shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
            raise ValueError(f"counts: expected shape ({self.num_experts},) [E], got {shape}")
        if self.bias_rule == "quantile":
            self.set_bias(self.target_bias())
        else:
            self.correction_bias.copy_(bias_update(self.correction_bias, counts, self.bias_update_rate))

    def target_bias(self) -> torch.Tensor:
        """The quantile rule's bias [E] fp32 from the last training forward's router scores."""
        if self.last_router_scores is None:
            raise ValueError("update_bias: moe.bias_update 'quantile' needs the router scores of a training "
                             "forward (with autograd on) before the update")
        return quantile_bias(self.last_router_scores, self.top_k)

    @torch.no_grad()
    def set_bias(self, bias: torch.Tensor) -> None:
        """Replace the correction bias: bias [E] (kept fp32)."""
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.num_experts,):
            raise ValueError(f"bias: expected shape ({self.num_experts},) [E], got {getattr(bias, 'shape', bias)}")
        self.correction_bias.copy_(bias.to(self.correction_bias))
