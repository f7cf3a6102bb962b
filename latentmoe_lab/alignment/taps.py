"""Named taps: forward hooks that record a model's intermediate tensors (docs/design.md §8).

Tap points, in the order a forward reaches them (the order of every alignment table):

    embed                          token (and image) embeddings: the input of block 0       [B, T, hidden]
    layers.{i}.attn                block i's attention output (before the residual add)     [B, T, hidden]
    layers.{i}.moe.router_logits   fp32 router logits of a LatentMoE block                  [B, T, E]
    layers.{i}.moe.experts         the chosen experts and their weights (ExpertChoice)      [B, T, K]
    layers.{i}.ffn                 block i's FFN output (dense SwiGLU or LatentMoE)         [B, T, hidden]
    layers.{i}.residual            the residual stream after block i                        [B, T, hidden]
    norm                           the final RMSNorm                                        [B, T, hidden]
    logits                         the LM head, fp32                                        [B, T, vocab]

The names depend only on the config (`tap_points(config)`), so any two models of one config, and a
parallel layout once its ranks are gathered, tap the same names. Hooks return nothing and the router
wrapper returns what it was given: recording never changes an output.

Memory: every tap keeps only the tokens that `TokenSubset` selects (every stride-th position, at most
max_tokens of them), as fp32 copies on the CPU. Repeated forwards (decode steps, chunked prefill)
append along the token axis and count positions across calls, so the subset stays the same.
"""
from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE

DENSE_KINDS = ("embed", "attn", "router_logits", "ffn", "residual", "norm", "logits")


@dataclass(frozen=True)
class TapPoint:
    """One named tap; layer is None for embed / norm / logits."""

    name: str
    kind: str
    layer: int | None = None


@dataclass(frozen=True)
class TokenSubset:
    """Which token positions a tap keeps: 0, stride, 2*stride, ... and at most max_tokens of them."""

    stride: int = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or self.stride < 1:
            raise ValueError(f"stride: must be an integer >= 1, got {self.stride!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens: must be None or an integer >= 1, got {self.max_tokens!r}")

    def keep(self, offset: int, length: int) -> torch.Tensor:
        """Positions offset .. offset+length-1 of a call -> the local indices [t_kept] int64 to keep."""
        positions = torch.arange(offset, offset + length)
        kept = positions % self.stride == 0
        if self.max_tokens is not None:
            kept &= positions // self.stride < self.max_tokens
        return kept.nonzero().flatten()


@dataclass
class ExpertChoice:
    """A router's decision for the kept tokens: indices [B, T, K] int64 and weights [B, T, K] fp32."""

    indices: torch.Tensor
    weights: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.indices.shape)


@dataclass
class Recording:
    """What one `record_taps` block saw: tap name -> tensor (or ExpertChoice), positions [t_kept]."""

    points: list[TapPoint]
    values: dict[str, torch.Tensor | ExpertChoice] = field(default_factory=dict)
    positions: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor | ExpertChoice:
        if name not in self.values:
            raise KeyError(f"tap {name!r} was not recorded; recorded: {list(self.values)}")
        return self.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def names(self) -> list[str]:
        """Recorded names in tap order."""
        return [p.name for p in self.points if p.name in self.values]

    def add(self, name: str, value: torch.Tensor | ExpertChoice, positions: torch.Tensor) -> None:
        """Append a call's kept tokens along the token axis (dim 1)."""
        if name not in self.values:
            self.values[name], self.positions[name] = value, positions
            return
        old = self.values[name]
        if isinstance(value, ExpertChoice):
            self.values[name] = ExpertChoice(torch.cat([old.indices, value.indices], 1),
                                             torch.cat([old.weights, value.weights], 1))
        else:
            self.values[name] = torch.cat([old, value], 1)
        self.positions[name] = torch.cat([self.positions[name], positions])


def tap_points(config: ModelConfig) -> list[TapPoint]:
    """Every tap of a model of `config`, in forward order."""
    points = [TapPoint("embed", "embed")]
    for i in range(config.num_layers):
        points.append(TapPoint(f"layers.{i}.attn", "attn", i))
        if config.is_moe_layer(i):
            points += [TapPoint(f"layers.{i}.moe.router_logits", "router_logits", i),
                       TapPoint(f"layers.{i}.moe.experts", "experts", i)]
        points += [TapPoint(f"layers.{i}.ffn", "ffn", i), TapPoint(f"layers.{i}.residual", "residual", i)]
    return points + [TapPoint("norm", "norm"), TapPoint("logits", "logits")]


def model_parts(model: nn.Module):
    """(config, [(global layer index, block)], norm or None, lm_head or None) of a model or a wrapper.

    Takes a LatentMoEForCausalLM, a parallel rank's ShardedCausalLM (`blocks` + `layer_ids`; a stage
    without the head has norm / lm_head None), or any module that wraps one as `.model`.
    """
    while not hasattr(model, "config") and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model
    if hasattr(model, "layers"):
        blocks = list(enumerate(model.layers))
    elif hasattr(model, "blocks") and hasattr(model, "layer_ids"):
        blocks = list(zip(model.layer_ids, model.blocks))
    else:
        raise TypeError(f"model: expected a LatentMoEForCausalLM, a ShardedCausalLM or a module wrapping one "
                        f"as .model, got {type(model).__name__}")
    return model.config, blocks, getattr(model, "norm", None), getattr(model, "lm_head", None)


def _find_moe(ffn: nn.Module) -> LatentMoE | None:
    """The LatentMoE inside a block's FFN (itself, or wrapped by a parallel layout)."""
    return next((m for m in ffn.modules() if isinstance(m, LatentMoE)), None)


class _Recorder:
    """Keeps the subset of each tapped tensor; one position counter per tap."""

    def __init__(self, recording: Recording, subset: TokenSubset, only: Collection[str] | None):
        self.recording, self.subset, self.only = recording, subset, only
        self.offsets: dict[str, int] = {}

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only

    def _kept(self, name: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        offset = self.offsets.get(name, 0)
        self.offsets[name] = offset + length
        local = self.subset.keep(offset, length)
        return local, local + offset

    def dense(self, name: str, tensor: torch.Tensor) -> None:
        """tensor [B, T, ...] -> keep [B, t_kept, ...] fp32 on the CPU."""
        local, positions = self._kept(name, tensor.shape[1])
        kept = tensor.detach().index_select(1, local.to(tensor.device))
        self.recording.add(name, kept.float().cpu(), positions)

    def choice(self, name: str, indices: torch.Tensor, weights: torch.Tensor) -> None:
        local, positions = self._kept(name, indices.shape[1])
        self.recording.add(name, ExpertChoice(indices.detach().index_select(1, local.to(indices.device)).cpu(),
                                              weights.detach().index_select(1, local.to(weights.device)).float().cpu()),
                           positions)


@contextlib.contextmanager
def record_taps(model: nn.Module, subset: TokenSubset = TokenSubset(),
                only: Collection[str] | None = None) -> Iterator[Recording]:
    """Record the taps of every forward run inside the block; `only` limits the names recorded.

        with record_taps(model, TokenSubset(stride=4, max_tokens=256)) as rec:
            model(input_ids)
        rec["layers.3.moe.router_logits"]      # [B, t_kept, E] fp32
    """
    if not isinstance(subset, TokenSubset):
        raise TypeError(f"subset: expected a TokenSubset, got {type(subset).__name__}")
    config, blocks, norm, lm_head = model_parts(model)
    points = tap_points(config)
    if only is not None:
        unknown = sorted(set(only) - {p.name for p in points})
        if unknown:
            raise ValueError(f"only: unknown tap names {unknown}; see tap_points(config)")
    recording = Recording(points)
    recorder = _Recorder(recording, subset, only)
    handles, patched = [], []

    def output_hook(name: str):
        def hook(module, args, output):
            recorder.dense(name, output)
        return hook

    def attach(name: str, module: nn.Module | None) -> None:
        if module is not None and recorder.wanted(name):
            handles.append(module.register_forward_hook(output_hook(name)))

    try:
        for i, block in blocks:
            if i == 0 and recorder.wanted("embed"):
                handles.append(block.register_forward_pre_hook(
                    lambda module, args, kwargs: recorder.dense("embed", _first_input(args, kwargs)), with_kwargs=True))
            attach(f"layers.{i}.attn", block.attn)
            attach(f"layers.{i}.ffn", block.ffn)
            attach(f"layers.{i}.residual", block)
            moe = _find_moe(block.ffn)
            if moe is not None:
                patched.append((moe, moe.__dict__.get("select_experts")))
                _wrap_router(moe, i, recorder, handles, block.ffn)
        attach("norm", norm)
        attach("logits", lm_head)
        yield recording
    finally:
        for handle in handles:
            handle.remove()
        for moe, previous in reversed(patched):
            if previous is None:
                del moe.select_experts  # the instance attribute; the class method shows through again
            else:
                moe.select_experts = previous  # an outer record_taps block is still recording


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden state x a block or FFN is called with, positionally or as x=."""
    return args[0] if args else kwargs["x"]


def _wrap_router(moe: LatentMoE, layer: int, recorder: _Recorder, handles: list, ffn: nn.Module) -> None:
    """Wrap `moe.select_experts` (fp32 logits [N, E] -> weights, indices) on the instance.

    Every forward path routes through it (LatentMoE.forward, route(), a parallel layout's MoE). The
    rows arrive flattened as (b t); the batch size comes from the FFN's input, seen by a pre-hook.
    """
    logits_name, experts_name = f"layers.{layer}.moe.router_logits", f"layers.{layer}.moe.experts"
    batch = {}
    handles.append(ffn.register_forward_pre_hook(
        lambda module, args, kwargs: batch.__setitem__("b", _first_input(args, kwargs).shape[0]), with_kwargs=True))
    original = moe.select_experts

    def select_experts(logits: torch.Tensor):
        weights, indices = original(logits)
        b = batch.get("b", 1)
        if recorder.wanted(logits_name):
            recorder.dense(logits_name, logits.reshape(b, -1, logits.shape[-1]))
        if recorder.wanted(experts_name):
            recorder.choice(experts_name, indices.reshape(b, -1, indices.shape[-1]),
                            weights.reshape(b, -1, weights.shape[-1]))
        return weights, indices

    moe.select_experts = select_experts
