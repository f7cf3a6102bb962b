"""QuantLatentExperts: the routed experts of a LatentMoE layer with packed weights (docs/design.md §1.2, §7).

A drop-in for `layers.moe.LatentExperts` (same forward(z_perm, counts) contract, set from outside as
`layer.experts = QuantLatentExperts.from_experts(...)`, the way expert parallelism swaps in its shard).
Buffers, with the input dim last so MXFP4 blocks run along it:
    w13_data / w13_scale   the [E, 2*inter, latent] weight (gate | up rows), i.e. LatentExperts.w13 transposed
    w2_data  / w2_scale    the [E, latent, inter] weight, LatentExperts.w2 transposed
forward goes through the same grouped path as the plain experts (ops.routing.grouped_matmul), but only over
the experts that received rows, a few at a time: each tile of experts is dequantized to fp32, multiplied with
fp32 accumulation, and dropped, so an expert with no tokens is never dequantized.
The twin `reference_forward` dequantizes every expert, then one plain matmul per expert.
backend ("auto" | "torch" | "triton", ops.backend rules): fp8 and mxfp4 experts on CUDA run
latentmoe_kernels.dequant_gemm instead, which decodes the packed tiles inside the GEMM.
"""
from __future__ import annotations

import torch
from torch import nn

from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.ops.backend import resolve_backend
from latentmoe_lab.ops.routing import expert_glu, grouped_matmul, grouped_matmul_reference
from latentmoe_lab.quant.activations import ActivationQuantizer, keep_fp32_buffers
from latentmoe_lab.quant.linear import weight_format

# Dequantized fp32 weights alive at once: 64 MiB is one tile of ~8 small-preset experts, a fraction of a
# k3-2.8t expert's 132 MB, so a full-scale tile is one expert.
TILE_BYTES = 64 * 2**20


def _glu(gate_up: torch.Tensor, clamp: float | None, situ_betas: tuple[float, float] | None) -> torch.Tensor:
    """[..., 2*inter] (gate | up) -> the experts' activation: SwiGLU (optional clamp), or SiTU with situ_betas."""
    gate, up = gate_up.chunk(2, dim=-1)
    return expert_glu(gate, up, clamp, situ_betas)


class QuantLatentExperts(nn.Module):
    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int, fmt: str,
                 activation_clamp: float | None = None, act13: ActivationQuantizer | None = None,
                 act2: ActivationQuantizer | None = None, device=None,
                 situ_betas: tuple[float, float] | None = None):
        super().__init__()
        self.num_experts, self.latent_size, self.intermediate_size = num_experts, latent_size, intermediate_size
        self.activation_clamp = activation_clamp
        self.situ_betas = situ_betas  # (beta_gate, beta_up): SiTU experts as LatentExperts has them (§18)
        self.format = weight_format(fmt)
        shapes = {"w13": (num_experts, 2 * intermediate_size, latent_size),
                  "w2": (num_experts, latent_size, intermediate_size)}
        for name, shape in shapes.items():
            for key, tensor in self.format.empty(shape, device).items():
                self.register_buffer(f"{name}_{key}", tensor)
        self.act13, self.act2 = act13, act2
        self.backend = "auto"

    @classmethod
    def from_experts(cls, experts: LatentExperts, fmt: str, act13: ActivationQuantizer | None = None,
                     act2: ActivationQuantizer | None = None) -> "QuantLatentExperts":
        num_experts, latent, two_inter = experts.w13.shape
        module = cls(num_experts, latent, two_inter // 2, fmt, experts.activation_clamp, act13, act2,
                     experts.w13.device, experts.situ_betas)
        for name in ("w13", "w2"):
            for key, tensor in module.format.pack(getattr(experts, name).detach().transpose(1, 2)).items():
                setattr(module, f"{name}_{key}", tensor)
        return module

    def _weights(self, name: str, experts: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized [e, D_in, D_out] fp32 (grouped_matmul's order) for the given expert ids (all if None)."""
        packed = {key: getattr(self, f"{name}_{key}") for key in ("data", "scale")}
        if experts is not None:
            packed = {key: tensor[experts] for key, tensor in packed.items()}
        in_features = self.latent_size if name == "w13" else self.intermediate_size
        return self.format.unpack(packed)[..., :in_features].transpose(1, 2)

    def _quantize_input(self, quantizer: ActivationQuantizer | None, x: torch.Tensor) -> torch.Tensor:
        return x.float() if quantizer is None else quantizer(x)

    def _check_counts(self, counts: torch.Tensor) -> None:
        if counts.dim() != 1 or counts.shape[0] != self.num_experts:
            raise ValueError(f"counts: expected shape ({self.num_experts},) [E], got {tuple(counts.shape)}")

    def forward(self, z_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """z_perm [M, latent] expert-major, counts [E] rows per expert -> [M, latent] in z_perm's dtype."""
        self._check_counts(counts)
        offsets = counts.cumsum(0)
        if self.format.name in ("fp8", "mxfp4") and resolve_backend(self.backend, z_perm) == "triton":
            return self._forward_triton(z_perm, offsets)
        active = counts.nonzero().flatten()
        out = torch.empty(z_perm.shape[0], self.latent_size, dtype=torch.float32, device=z_perm.device)
        per_expert = 3 * self.latent_size * self.intermediate_size * 4  # fp32 bytes of one expert's weights
        step = max(1, TILE_BYTES // per_expert)
        for first in range(0, active.numel(), step):
            ids = active[first:first + step]
            start, stop = int(offsets[ids[0]] - counts[ids[0]]), int(offsets[ids[-1]])
            tile_offsets = offsets[ids] - start  # end offset of each tile expert's rows inside the tile
            hidden = _glu(grouped_matmul(self._quantize_input(self.act13, z_perm[start:stop]),
                                         self._weights("w13", ids), tile_offsets), self.activation_clamp,
                          self.situ_betas)
            out[start:stop] = grouped_matmul(self._quantize_input(self.act2, hidden), self._weights("w2", ids),
                                             tile_offsets)
        return out.to(z_perm.dtype)

    def _forward_triton(self, z_perm: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from latentmoe_kernels.dequant_gemm import dequant_grouped_gemm

        fmt = self.format.name
        gate_up = dequant_grouped_gemm(self._quantize_input(self.act13, z_perm), self.w13_data, self.w13_scale,
                                       offsets, fmt, self.latent_size)
        hidden = self._quantize_input(self.act2, _glu(gate_up, self.activation_clamp, self.situ_betas))
        return dequant_grouped_gemm(hidden, self.w2_data, self.w2_scale, offsets, fmt,
                                    self.intermediate_size).to(z_perm.dtype)

    def reference_forward(self, z_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Twin of forward: every expert dequantized, one plain matmul per expert slice."""
        self._check_counts(counts)
        offsets = counts.cumsum(0)
        hidden = _glu(grouped_matmul_reference(self._quantize_input(self.act13, z_perm), self._weights("w13"),
                                               offsets), self.activation_clamp, self.situ_betas)
        return grouped_matmul_reference(self._quantize_input(self.act2, hidden), self._weights("w2"),
                                        offsets).to(z_perm.dtype)

    def expert_reference(self, z: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert_e(z) for one latent token z [latent] -> [latent] (what LatentMoE.reference_forward calls)."""
        ids = torch.tensor([expert], device=z.device)
        hidden = _glu(self._quantize_input(self.act13, z[None]) @ self._weights("w13", ids)[0], self.activation_clamp,
                      self.situ_betas)
        return (self._quantize_input(self.act2, hidden) @ self._weights("w2", ids)[0])[0].to(z.dtype)

    def _apply(self, fn, recurse=True):
        return keep_fp32_buffers(self, fn, recurse, super()._apply)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, latent={self.latent_size}, inter={self.intermediate_size}, "
                f"format={self.format.name}")
