"""Expert load: tokens per rank under a placement, balancedness, and a sliding-window load recorder
(docs/design.md §14).

    load = rank_loads(weight [L, E], phy2log [L, P], logcnt [L, E], num_ranks)   # [L, ranks]
    balance_metrics(load)   # per layer, reduced over the rank axis, then averaged over layers

A logical expert's load is split evenly over its replicas (the dispatcher spreads its tokens), so a
slot carries weight[e] / logcnt[e] and a rank the sum over its P / ranks slots.

    balancedness = mean / max tokens per rank    1 = perfectly even, 1 / ranks = one rank does everything
    imbalance    = (max - mean) / mean           0 = perfectly even

A layer that carried no tokens counts as balanced (1 and 0).

`ExpertLoadRecorder` keeps the routed-token counts of the last `window_steps` steps, per MoE layer and
logical expert, from the routing itself (`LatentMoE.last_expert_counts`, which every forward sets from
the router's choices), in the trainer and the serving engine alike; its window is the `weight` the
balancer reads.
"""
from __future__ import annotations

import torch
from torch import nn

from latentmoe_lab.parallel.eplb.rebalance import default_placement


def rank_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """weight [L, E], phy2log [L, P], logcnt [L, E] -> tokens per rank [L, num_ranks] fp64."""
    if weight.dim() != 2 or phy2log.dim() != 2 or tuple(logcnt.shape) != tuple(weight.shape) \
            or phy2log.shape[0] != weight.shape[0]:
        raise ValueError(f"phy2log: shapes must be weight [L, E], phy2log [L, P], logcnt [L, E]; got "
                         f"{tuple(weight.shape)}, {tuple(phy2log.shape)}, {tuple(logcnt.shape)}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1 \
            or phy2log.shape[1] % num_ranks:
        raise ValueError(f"num_ranks: must be a positive integer dividing the {phy2log.shape[1]} slots, "
                         f"got {num_ranks!r}")
    per_replica = weight.double() / logcnt.double()
    slot_load = per_replica.gather(1, phy2log)
    return slot_load.view(weight.shape[0], num_ranks, -1).sum(-1)


def balance_metrics(load: torch.Tensor) -> dict:
    """load [L, ranks] tokens per rank -> {"balancedness", "imbalance"} (means over layers, floats) and
    {"balancedness_per_layer", "imbalance_per_layer"} ([L] fp64): each reduced over the rank axis."""
    if not isinstance(load, torch.Tensor) or load.dim() != 2 or load.numel() == 0:
        shape = tuple(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__
        raise ValueError(f"load: expected a non-empty 2-D tensor [layers, ranks], got {shape}")
    load = load.double()
    mean, peak = load.mean(dim=1), load.max(dim=1).values
    idle = peak == 0
    balancedness = torch.where(idle, 1.0, mean / peak.clamp_min(1e-300))
    imbalance = torch.where(idle, 0.0, (peak - mean) / mean.clamp_min(1e-300))
    return {"balancedness": float(balancedness.mean()), "imbalance": float(imbalance.mean()),
            "balancedness_per_layer": balancedness, "imbalance_per_layer": imbalance}


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's LatentMoE layers in depth order (inside a ParallelMoE wrapper too)."""
    from latentmoe_lab.layers.moe import LatentMoE

    return [module for module in model.modules() if isinstance(module, LatentMoE)]


class ExpertLoadRecorder:
    """Routed tokens per (MoE layer, logical expert) over the last `window_steps` recorded steps.

    record(counts [L, E]) adds one step; `window` [L, E] int64 is the sum over the window, `total` the
    sum since the start. attach(model) records one step after every forward of `model` from its MoE
    layers' `last_expert_counts`.
    """

    def __init__(self, num_layers: int, num_experts: int, window_steps: int):
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts),
                            ("window_steps", window_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        self.window_steps = window_steps
        self._ring = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64)
        self.window = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.total = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.steps = 0

    def record(self, counts: torch.Tensor) -> None:
        """One step's counts [L, E] (non-negative integers)."""
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != tuple(self.window.shape):
            shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
            raise ValueError(f"counts: expected shape {tuple(self.window.shape)} [layers, experts], got {shape}")
        counts = counts.detach().to("cpu", torch.int64)
        if (counts < 0).any():
            raise ValueError("counts: must be >= 0")
        slot = self.steps % self.window_steps
        self.window += counts - self._ring[slot]  # the step that leaves the window is subtracted
        self._ring[slot] = counts
        self.total += counts
        self.steps += 1

    def record_model(self, model: nn.Module) -> None:
        """One step from the MoE layers' last_expert_counts."""
        self.record(torch.stack([layer.last_expert_counts.cpu() for layer in moe_layers(model)]))

    def attach(self, model: nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Record a step after each forward of `model`; returns the hook handle."""
        if len(moe_layers(model)) != self.window.shape[0]:
            raise ValueError(f"model: has {len(moe_layers(model))} MoE layers, the recorder "
                             f"{self.window.shape[0]}")
        return model.register_forward_hook(lambda module, args, output: self.record_model(module))

    @classmethod
    def for_model(cls, model: nn.Module, window_steps: int) -> "ExpertLoadRecorder":
        layers = moe_layers(model)
        if not layers:
            raise ValueError("model: has no MoE layer to record")
        return cls(len(layers), layers[0].num_experts, window_steps)

    def balance(self, num_ranks: int, placement: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
        """balance_metrics of the window over num_ranks ranks; placement (phy2log, logcnt), default one
        slot per expert in order (parallel/expert.py's layout)."""
        if placement is None:
            phy2log, _, logcnt = default_placement(*self.window.shape)
            placement = (phy2log, logcnt)
        return balance_metrics(rank_loads(self.window, placement[0], placement[1], num_ranks))
