"""Rotary position embedding (RoPE) with optional YaRN context extension (docs/design.md §17).

Each pair of channels (a, b) of a rotated vector at position p turns by the angle p * f_i:

    a' = c (a cos(p f_i) - b sin(p f_i))        b' = c (b cos(p f_i) + a sin(p f_i))

with f_i = theta^(-2i / dim), i < dim / 2, and c the YaRN attention factor (1 without YaRN). Two pairings:
  interleaved - pair i is channels (2i, 2i + 1)          (DeepSeek's MLA rope dims)
  half-split  - pair i is channels (i, i + dim / 2)       (DeepSeek-V3.2's indexer)
Rotating queries and keys alike makes their dot product depend on the positions only through p_q - p_k.

YaRN (factor s, pre-training length L, beta_fast, beta_slow): frequency i interpolates between f_i
(extrapolation, the fast-turning channels) and f_i / s (interpolation, the slow ones) with a linear ramp
over the channels whose number of turns within L lies between beta_fast and beta_slow;
c = m(s, mscale) / m(s, mscale_all_dim), or m(s, 1) when either is unset, with m(s, k) = 0.1 k ln s + 1
for s > 1 (else 1). MLA models also multiply the softmax scale by m(s, mscale_all_dim)^2 (`yarn_softmax_scale`).
Frequencies and angles are computed in fp32 (as the published checkpoints were), and the rotation in the
input's dtype after a cast of cos / sin, so a port reproduces the same roundings.

`rotate` is the one product the layers call; `rotate_reference` is its twin, written as a complex product.
"""
from __future__ import annotations

import math

import torch

PAIRINGS = ("interleaved", "half")


def yarn_mscale(factor: float, mscale: float) -> float:
    """m(s, k) = 0.1 k ln s + 1 for s > 1, else 1 (the YaRN attention temperature)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None,
                          attention_factor: float | None) -> float:
    """c, the factor on cos and sin: given, else m(s, mscale) / m(s, mscale_all_dim) when both are set
    (non-zero), else m(s, 1)."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor, 1.0)


def yarn_softmax_scale(factor: float, mscale_all_dim: float | None) -> float:
    """The factor MLA applies to its softmax scale under YaRN: m(s, mscale_all_dim)^2 (1 when unset)."""
    return yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0


def inverse_frequencies(dim: int, theta: float, factor: float = 1.0, original_max_position: int | None = None,
                        beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
                        yarn: bool = False) -> torch.Tensor:
    """f [dim / 2] fp32: theta^(-2i / dim), or with yarn=True the YaRN blend of f and f / factor."""
    if not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim: rotary dims must be an even integer >= 2, got {dim!r}")
    if not theta > 1:
        raise ValueError(f"theta: must be > 1, got {theta!r}")
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    wavelength_base = theta ** exponents  # theta^(2i / dim)
    if not yarn:
        return 1.0 / wavelength_base
    if not factor >= 1:
        raise ValueError(f"factor: the YaRN factor must be >= 1, got {factor!r}")
    if not isinstance(original_max_position, int) or original_max_position < 1:
        raise ValueError(f"original_max_position: YaRN needs the pre-training length, got {original_max_position!r}")

    def channel_for_turns(turns: float) -> float:  # the (fractional) dim whose frequency turns `turns` times in L
        return dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_for_turns(beta_fast), channel_for_turns(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep f_i), 0: interpolate (f_i / factor)
    return (1.0 / (factor * wavelength_base)) * (1 - keep) + (1.0 / wavelength_base) * keep


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int, inv_freq [dim / 2] -> (c cos, c sin), each [..., dim / 2] fp32."""
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions: expected an integer tensor, got {getattr(positions, 'dtype', type(positions))}")
    angles = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """x [..., T, H, dim] rotated by cos, sin [..., T, dim / 2] (shared by the H heads; leading dims may
    broadcast) -> [..., T, H, dim].

    cos / sin are cast to x's dtype first; the output keeps each pairing's channel layout.
    """
    first, second, cos, sin = _split(x, cos, sin, pairing)
    out_first, out_second = first * cos - second * sin, second * cos + first * sin
    if pairing == "half":
        return torch.cat([out_first, out_second], dim=-1)
    return torch.stack([out_first, out_second], dim=-1).flatten(-2)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """Twin of `rotate`: each pair as a complex number a + ib, multiplied by c e^(i p f)."""
    first, second, cos, sin = _split(x, cos, sin, pairing)
    turned = torch.complex(first.double(), second.double()) * torch.complex(cos.double(), sin.double())
    pairs = torch.stack([turned.real, turned.imag], dim=-2 if pairing == "half" else -1)
    return pairs.flatten(-2).to(x.dtype)


class RotaryEmbedding:
    """Rotates the `dim` rope channels of queries / keys at their positions; cos and sin are recomputed per call
    in fp32 from the fp32 frequencies (kept off the module tree, so a model cast to bf16 leaves them exact).

    __call__(x [B, T, H, dim] or [B, T, dim], positions [B or 1, T] int) -> x rotated, same shape and dtype.
    """

    def __init__(self, dim: int, pairing: str, theta: float, yarn: bool = False, factor: float = 1.0,
                 original_max_position: int | None = None, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 mscale: float | None = None, mscale_all_dim: float | None = None,
                 attention_factor: float | None = None, truncate: bool = True):
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing: expected one of {PAIRINGS}, got {pairing!r}")
        self.dim, self.pairing = dim, pairing
        self.inv_freq = inverse_frequencies(dim, theta, factor, original_max_position, beta_fast, beta_slow,
                                            truncate, yarn)
        self.attention_factor = (yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor)
                                 if yarn else 1.0)

    @classmethod
    def from_config(cls, mla, pairing: str, dim: int | None = None) -> "RotaryEmbedding | None":
        """The rotary of an MLAConfig's mla.rope / mla.rope_theta / mla.yarn_* fields over `dim` channels
        (default qk_rope_head_dim); None for NoPE (mla.rope == "none")."""
        if mla.rope == "none":
            return None
        return cls(mla.qk_rope_head_dim if dim is None else dim, pairing, mla.rope_theta, yarn=mla.rope == "yarn",
                   factor=mla.yarn_factor, original_max_position=mla.yarn_original_max_position,
                   beta_fast=mla.yarn_beta_fast, beta_slow=mla.yarn_beta_slow, mscale=mla.yarn_mscale,
                   mscale_all_dim=mla.yarn_mscale_all_dim, attention_factor=mla.yarn_attention_factor,
                   truncate=mla.yarn_truncate)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"x: expected {self.dim} rope channels in the last dim, got shape {tuple(x.shape)}")
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.attention_factor)
        if x.dim() == 3:  # one shared key head: [B, T, dim]
            return rotate(x[:, :, None], cos, sin, self.pairing)[:, :, 0]
        return rotate(x, cos, sin, self.pairing)


def _split(x, cos, sin, pairing):
    """The two channels of every pair of x, and cos / sin broadcast over its heads, in x's dtype."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing: expected one of {PAIRINGS}, got {pairing!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3:
        raise ValueError(f"x: expected a floating tensor [..., T, H, dim], got {getattr(x, 'shape', type(x))}")
    half = x.shape[-1] // 2
    if x.shape[-1] % 2 or cos.shape != sin.shape or cos.shape[-1] != half or not _broadcasts(cos.shape[:-1],
                                                                                            x.shape[:-2]):
        raise ValueError(f"cos, sin: expected shape {(*x.shape[:-2], half)} (or one that broadcasts to it) for x "
                         f"{tuple(x.shape)} (an even dim), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    cos, sin = cos.to(x.dtype)[..., None, :], sin.to(x.dtype)[..., None, :]
    if pairing == "half":
        return x[..., :half], x[..., half:], cos, sin
    return x[..., 0::2], x[..., 1::2], cos, sin


def _broadcasts(small: torch.Size, large: torch.Size) -> bool:
    """True when `small` broadcasts to exactly `large`."""
    try:
        return torch.broadcast_shapes(small, large) == large
    except RuntimeError:
        return False
