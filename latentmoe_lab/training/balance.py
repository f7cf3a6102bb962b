"""A small CPU training run that compares three ways to balance the experts (docs/design.md §1.2).

    "none"  cross-entropy only
    "bias"  cross-entropy only; after every optimizer step each MoE layer updates its bias by
            moe.bias_update: b <- b + u * sign(mean(c) - c) on the step's counts, or K3's quantile
            rule on the step's router scores (no loss term, no gradient)
    "aux"   cross-entropy + the sequence-wise auxiliary loss of every MoE layer

Every mode starts from the same weights and sees the same batches, so the curves differ only
by the balancing. The data is synthetic and skewed on purpose: tokens follow a fixed random
successor with probability `follow`, else a Zipf(1.1) draw, so a few frequent tokens dominate,
as in real text, and routers drift towards a few experts unless something pushes back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.model import LatentMoEForCausalLM

MODES = ("none", "bias", "aux")


@dataclass(frozen=True)
class BalanceHistory:
    """One run. max_over_mean [steps, L] per MoE layer, loss [steps] (cross-entropy only),
    final_counts [L, E] tokens per expert over the last `tail` steps, layer_labels [L]."""

    mode: str
    max_over_mean: torch.Tensor
    loss: torch.Tensor
    final_counts: torch.Tensor
    layer_labels: list[str]

    @property
    def mean_max_over_mean(self) -> torch.Tensor:
        """[steps]: max/mean load averaged over the MoE layers."""
        return self.max_over_mean.mean(-1)


def balance_config(preset: str = "tiny", aux_loss_alpha: float = 0.01, bias_update_rate: float = 1e-2,
                   **moe_changes) -> ModelConfig:
    """The preset with a group-free router (group limits would cap the imbalance we want to see).

    The bias rate is 10x the full-scale 1e-3: a run of a few hundred steps must cross the score gaps
    that a collapsed router builds in its first few dozen.
    """
    base = ModelConfig.from_preset(preset)
    moe = {**base.to_dict()["moe"], "n_group": 1, "topk_group": 1, "aux_loss_alpha": aux_loss_alpha,
           "bias_update_rate": bias_update_rate, **moe_changes}
    return base.replace(moe=moe)


def skewed_batches(vocab_size: int, batch: int, seq_len: int, seed: int = 0, follow: float = 0.5):
    """Endless [batch, seq_len] int64 batches: a random successor map mixed with Zipf(1.1) draws."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab_size, generator=g)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64) ** 1.1
    rank_to_token = torch.randperm(vocab_size, generator=g)
    while True:
        fresh = rank_to_token[torch.multinomial(zipf, batch * seq_len, replacement=True, generator=g)]
        fresh = fresh.view(batch, seq_len)
        follows = torch.rand(batch, seq_len, generator=g) < follow
        ids = torch.empty_like(fresh)
        ids[:, 0] = fresh[:, 0]
        for t in range(1, seq_len):  # data generation, not the model: one step per position
            ids[:, t] = torch.where(follows[:, t], successor[ids[:, t - 1]], fresh[:, t])
        yield ids


def _moe_layers(model: LatentMoEForCausalLM) -> list[tuple[str, LatentMoE]]:
    return [(f"layer {i}", block.ffn) for i, block in enumerate(model.layers) if isinstance(block.ffn, LatentMoE)]


def train_balancing(mode: str, config: ModelConfig | None = None, steps: int = 300, batch: int = 8,
                    seq_len: int = 64, lr: float = 3e-3, seed: int = 0, tail: int = 20,
                    progress: Callable[[int, float, float], None] | None = None) -> BalanceHistory:
    """Train `config` (default `balance_config()`) for `steps` AdamW steps in one balancing mode."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
    for name, value in (("steps", steps), ("batch", batch), ("seq_len", seq_len), ("tail", tail)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    config = balance_config() if config is None else config
    if not config.moe.aux_loss_alpha > 0 and mode == "aux":
        raise ValueError("config: mode 'aux' needs moe.aux_loss_alpha > 0")
    torch.manual_seed(seed)
    model = LatentMoEForCausalLM(config)
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("config: has no MoE layer (num_layers <= first_dense_layers)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = skewed_batches(config.vocab_size, batch, seq_len + 1, seed=seed)
    ratios = torch.zeros(steps, len(layers))
    losses = torch.zeros(steps)
    tail_counts = torch.zeros(len(layers), config.moe.num_experts, dtype=torch.int64)
    for step in range(steps):
        ids = next(data)
        logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
        total = loss + sum(layer.last_aux_loss for _, layer in layers) if mode == "aux" else loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        for j, (_, layer) in enumerate(layers):
            counts = layer.last_expert_counts
            ratios[step, j] = counts.max() / counts.float().mean()
            if step >= steps - tail:
                tail_counts[j] += counts
            if mode == "bias":
                layer.update_bias(counts)
        losses[step] = loss.detach()
        if progress is not None:
            progress(step, float(loss.detach()), float(ratios[step].mean()))
    return BalanceHistory(mode=mode, max_over_mean=ratios, loss=losses, final_counts=tail_counts,
                          layer_labels=[label for label, _ in layers])


def compare_balancing(modes: Sequence[str] = MODES, **kwargs) -> dict[str, BalanceHistory]:
    """`train_balancing` once per mode with identical seeds and data; kwargs go to every run."""
    return {mode: train_balancing(mode, **kwargs) for mode in modes}
