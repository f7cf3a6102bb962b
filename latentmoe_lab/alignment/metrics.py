"""Error metrics between a reference tensor and a candidate of the same shape (docs/design.md §8).

Every metric takes (reference, candidate) and computes in float64, whatever the storage dtype.
With r the reference and c the candidate, flattened:

    cosine        sum(r c) / (|r| |c|)                      1 = same direction
    relative_l2   |c - r| / |r|                             0 = equal
    rel_diff      1 - 2 sum(r c) / (sum r^2 + sum c^2)      0 = equal; symmetric, also sees a scale error
    sqnr_db       10 log10(sum r^2 / sum (c - r)^2)         inf = equal; 6 dB per bit of agreement
    max_abs_error max |c - r| and its index

Router decisions (ExpertChoice): routing flips, the share of tokens whose *set* of experts changed
(order inside the top-k does not matter), and the weight error on the tokens whose set did not.
Logits [N, V]: KL(ref || cand) per token, top-1 agreement, bits per byte of next-token targets
(the tokenizer is byte-level, so one token is one byte).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from latentmoe_lab.alignment.taps import ExpertChoice


def _pair(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("reference", reference), ("candidate", candidate)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if reference.shape != candidate.shape:
        raise ValueError(f"candidate: shape {tuple(candidate.shape)} differs from the reference's "
                         f"{tuple(reference.shape)}")
    return reference.detach().double().flatten(), candidate.detach().double().flatten()


def cosine(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Cosine similarity; two all-zero tensors count as 1, one all-zero tensor as 0."""
    r, c = _pair(reference, candidate)
    norms = float(r.norm() * c.norm())
    if norms == 0.0:
        return 1.0 if float(r.norm()) == float(c.norm()) else 0.0
    return float(r @ c) / norms


def relative_l2(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """|c - r| / |r|; inf when the reference is all zero and the candidate is not."""
    r, c = _pair(reference, candidate)
    error, scale = float((c - r).norm()), float(r.norm())
    if scale == 0.0:
        return 0.0 if error == 0.0 else math.inf
    return error / scale


def rel_diff(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """1 - 2 sum(r c) / (sum r^2 + sum c^2); 0 for two all-zero tensors."""
    r, c = _pair(reference, candidate)
    energy = float(r @ r + c @ c)
    if energy == 0.0:
        return 0.0
    return 1.0 - 2.0 * float(r @ c) / energy


def sqnr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(sum r^2 / sum (c - r)^2) in dB; inf when equal."""
    r, c = _pair(reference, candidate)
    noise, signal = float((c - r) @ (c - r)), float(r @ r)
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def max_abs_error(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """(max |c - r|, its index in the unflattened shape); the first index wins a tie; NaN counts as largest."""
    r, c = _pair(reference, candidate)
    if r.numel() == 0:
        return 0.0, ()
    error = (c - r).abs().nan_to_num(nan=math.inf)
    flat = int(error.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), reference.shape))
    return float((c - r).abs()[flat]), index


@dataclass(frozen=True)
class RoutingDiff:
    """tokens: routed tokens compared; flipped: how many changed their expert set; the weight errors are
    max / mean |w_c - w_r| over the (token, expert) pairs of unchanged sets (0 when none are unchanged)."""

    tokens: int
    flipped: int
    weight_max_abs: float
    weight_mean_abs: float

    @property
    def flip_rate(self) -> float:
        return self.flipped / self.tokens if self.tokens else 0.0


def routing_diff(reference: ExpertChoice, candidate: ExpertChoice) -> RoutingDiff:
    """Compare two routers' choices [..., K]: expert sets per token, weights matched by expert id."""
    for name, choice in (("reference", reference), ("candidate", candidate)):
        if not isinstance(choice, ExpertChoice):
            raise TypeError(f"{name}: expected an ExpertChoice, got {type(choice).__name__}")
    if reference.indices.shape != candidate.indices.shape:
        raise ValueError(f"candidate: expert indices of shape {tuple(candidate.indices.shape)} differ from the "
                         f"reference's {tuple(reference.indices.shape)}")
    top_k = reference.indices.shape[-1]
    r_idx, r_order = reference.indices.reshape(-1, top_k).sort(-1)
    c_idx, c_order = candidate.indices.reshape(-1, top_k).sort(-1)
    same = (r_idx == c_idx).all(-1)  # [N] the same set of experts
    r_w = reference.weights.reshape(-1, top_k).double().gather(-1, r_order)[same]
    c_w = candidate.weights.reshape(-1, top_k).double().gather(-1, c_order)[same]
    error = (c_w - r_w).abs()
    return RoutingDiff(tokens=int(same.numel()), flipped=int((~same).sum()),
                       weight_max_abs=float(error.max()) if error.numel() else 0.0,
                       weight_mean_abs=float(error.mean()) if error.numel() else 0.0)


def _logits_pair(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _pair(reference, candidate)
    if reference.dim() < 1 or reference.shape[-1] < 1:
        raise ValueError(f"reference: logits need a vocabulary axis last, got shape {tuple(reference.shape)}")
    vocab = reference.shape[-1]
    return reference.detach().double().reshape(-1, vocab), candidate.detach().double().reshape(-1, vocab)


def kl_per_token(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(softmax(r) || softmax(c)) in nats for each token: logits [..., V] -> [N] float64."""
    r, c = _logits_pair(reference, candidate)
    log_p, log_q = r.log_softmax(-1), c.log_softmax(-1)
    # KL >= 0; equal inputs can round to -1e-18, which would print as a negative divergence
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def top1_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Share of tokens whose argmax token is the same (logits [..., V]); 1.0 for no tokens."""
    r, c = _logits_pair(reference, candidate)
    if r.shape[0] == 0:
        return 1.0
    return float((r.argmax(-1) == c.argmax(-1)).double().mean())


def bits_per_byte(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean next-token cross-entropy in bits: logits [N, V], targets [N] int64 (byte tokens)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits: expected a tensor [N, V]")
    if not isinstance(targets, torch.Tensor) or targets.shape != logits.shape[:1] or targets.is_floating_point():
        raise ValueError(f"targets: expected integer ids of shape ({logits.shape[0]},), got "
                         f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    if targets.numel() == 0:
        raise ValueError("targets: need at least one target token")
    nats = torch.nn.functional.cross_entropy(logits.double(), targets.long(), reduction="mean")
    return float(nats) / math.log(2.0)


def bpb_delta(reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor) -> float:
    """bits_per_byte(candidate) - bits_per_byte(reference) on the same targets: > 0 means worse."""
    r, c = _logits_pair(reference, candidate)
    return bits_per_byte(c, targets.reshape(-1)) - bits_per_byte(r, targets.reshape(-1))
