"""Big-model placement with accelerate, and disk offload of cold experts behind an expert cache.

Full scale: `full_scale_device_map` builds k3-2.8t under `init_empty_weights` (no memory) and asks
accelerate's `infer_auto_device_map` where each decoder block goes for a cluster's `max_memory`
(devices first, then "cpu", then "disk"; a block is never split).

Small configs, for real: `offload_experts` swaps each MoE layer's `experts` for `OffloadedExperts`:
the `hot` most used experts stay resident (most used in a recorder's window of served traffic,
parallel/eplb/load.py, or in one calibration forward), every other expert lives in its own file on
disk and is read into an `ExpertCache` (LRU or LFU, fixed capacity) when a token routes to it.
`dispatch_with_offload` then places whole blocks on "cpu" or "disk" with accelerate's
`dispatch_model` from a device map. The logits stay exactly those of the resident model.

Both write into a fresh subfolder `model-XXXXXXXX` of the folder they are given, so two models
offloaded into one folder never read each other's files (the first used to run on the second's
experts, silently). Each expert file is also checked on every read against the shapes, dtypes and
CRC-32 recorded when it was written.
"""
from __future__ import annotations

import logging
import tempfile
import zlib
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentExperts, LatentMoE

POLICIES = ("lru", "lfu")


def full_scale_device_map(config: ModelConfig, max_memory: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{module name: device | "cpu" | "disk"} for `config` built on the meta device."""
    from accelerate import infer_auto_device_map

    from latentmoe_lab.meta import build_meta_model

    modeling_log = logging.getLogger("accelerate.utils.modeling")
    level = modeling_log.level
    modeling_log.setLevel(logging.ERROR)  # it warns about every GPU index this machine lacks
    try:
        return infer_auto_device_map(build_meta_model(config), max_memory=max_memory,
                                     no_split_module_classes=["DecoderBlock"], dtype=dtype)
    finally:
        modeling_log.setLevel(level)


class ExpertCache:
    """At most `capacity` experts' weights in memory; evicts the least recently ("lru") or least
    frequently ("lfu", ties to the least recent) used one. Counts hits and misses."""

    def __init__(self, capacity: int, policy: str = "lru"):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: must be a positive integer, got {capacity!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
        self.capacity, self.policy = capacity, policy
        self.entries: OrderedDict = OrderedDict()
        self.frequency: dict = {}
        self.hits = self.misses = 0

    def get(self, key, load):
        """The cached value for `key`, calling load() on a miss."""
        self.frequency[key] = self.frequency.get(key, 0) + 1
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        if len(self.entries) >= self.capacity:
            if self.policy == "lru":
                victim = next(iter(self.entries))
            else:  # OrderedDict order breaks frequency ties towards the least recent
                victim = min(self.entries, key=lambda k: self.frequency[k])
            del self.entries[victim]
        self.entries[key] = load()
        return self.entries[key]

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def stats(self) -> dict:
        return {"policy": self.policy, "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hit_rate}


class OffloadedExperts(nn.Module):
    """Drop-in for LatentExperts: forward(z_perm [M, latent] expert-major, counts [E]) -> [M, latent].

    Hot experts are buffers here; cold ones are files `<folder>/expert_<e>.pt` read through `cache`.
    `folder` must not hold expert files already (offload_experts gives every model its own).
    Only experts that received rows are gathered; one grouped matmul then runs over them with the
    layer's own LatentExperts code (through functional_call), so the math is unchanged.
    """

    def __init__(self, experts: LatentExperts, hot: list[int], folder: Path, cache: ExpertCache):
        super().__init__()
        self.num_experts = experts.w13.shape[0]
        self.hot = sorted(set(hot))
        self.folder, self.cache = Path(folder), cache
        self.folder.mkdir(parents=True, exist_ok=True)
        if any(self.folder.glob("expert_*.pt")):
            raise ValueError(f"folder: {str(self.folder)!r} already holds offloaded experts; give every layer "
                             f"of every model its own folder (offload_experts does)")
        self.register_buffer("hot_w13", experts.w13.detach()[self.hot].clone())
        self.register_buffer("hot_w2", experts.w2.detach()[self.hot].clone())
        self._hot_slot = {e: i for i, e in enumerate(self.hot)}
        self._written: dict[int, dict] = {}  # expert -> {name: (shape, dtype, crc32)} as written
        for e in range(self.num_experts):
            if e not in self._hot_slot:
                tensors = {"w13": experts.w13.detach()[e].clone(), "w2": experts.w2.detach()[e].clone()}
                torch.save(tensors, self.folder / f"expert_{e}.pt")
                self._written[e] = {k: _fingerprint(t) for k, t in tensors.items()}
        with torch.device("meta"):  # the code path only: its weights are replaced per call
            template = LatentExperts(1, experts.w13.shape[1], experts.w2.shape[1], experts.activation_clamp,
                                     experts.situ_betas)
        # not a registered submodule: its meta weights must stay out of state_dict and .to()
        object.__setattr__(self, "template", template)
        self.bytes_read = 0
        self.resident_uses = 0  # active experts served from the resident set (the cache counts the others)

    def _weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        if expert in self._hot_slot:
            slot = self._hot_slot[expert]
            return self.hot_w13[slot], self.hot_w2[slot]

        def load():
            path = self.folder / f"expert_{expert}.pt"
            loaded = torch.load(path, mmap=True, weights_only=True)
            found = {k: _fingerprint(loaded[k]) for k in ("w13", "w2") if isinstance(loaded.get(k), torch.Tensor)}
            if found != self._written[expert]:
                raise ValueError(f"{path}: holds other weights than were written there (shape, dtype or "
                                 f"checksum differ: {found} vs {self._written[expert]}); was the file replaced?")
            w13, w2 = (loaded[k].to(self.hot_w13.device, copy=True) for k in ("w13", "w2"))
            self.bytes_read += w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
            return w13, w2

        return self.cache.get((self.folder, expert), load)

    def forward(self, z_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if counts.dim() != 1 or counts.shape[0] != self.num_experts:
            raise ValueError(f"counts: expected shape ({self.num_experts},) [E], got {tuple(counts.shape)}")
        active = counts.nonzero().flatten().tolist()
        if not active:
            return z_perm.new_zeros(z_perm.shape)
        # fetching weights is per expert by nature (cache lookups and file reads); the math below is batched
        self.resident_uses += sum(e in self._hot_slot for e in active)
        weights = [self._weights(e) for e in active]
        w13 = torch.stack([w for w, _ in weights])
        w2 = torch.stack([w for _, w in weights])
        return functional_call(self.template, {"w13": w13, "w2": w2}, (z_perm, counts[active]))


def _fingerprint(tensor: torch.Tensor) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype, CRC-32 of the bytes) of a CPU tensor."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return tuple(tensor.shape), str(tensor.dtype), zlib.crc32(data)


def _model_folder(folder: str | Path) -> Path:
    """A new, empty subfolder `model-XXXXXXXX` of `folder` (created with it if needed), unique to one call."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="model-", dir=folder))


def hot_experts(counts: torch.Tensor, keep: int) -> list[int]:
    """The `keep` experts with the most routed tokens (counts [E], e.g. layer.last_expert_counts)."""
    return torch.argsort(counts, descending=True, stable=True)[:keep].tolist()


def offload_experts(model: nn.Module, folder: str | Path, hot: int, capacity: int, policy: str = "lru",
                    calibration: torch.Tensor | None = None,
                    frequencies: torch.Tensor | None = None) -> dict[int, OffloadedExperts]:
    """Replace every MoE layer's experts by OffloadedExperts in place; returns {layer: module}.

    The hot set per layer: the `hot` most routed experts of `frequencies` [MoE layers, E] (an
    ExpertLoadRecorder's window: the traffic actually served), else of one forward over `calibration`
    ids [B, T], else experts 0 .. hot-1. Each layer gets its own cache of `capacity` experts.
    Files go to `<folder>/model-XXXXXXXX/layer_<i>/`, a subfolder new to this call.
    """
    moe_blocks = [i for i, block in enumerate(model.layers) if isinstance(block.ffn, LatentMoE)]
    if frequencies is not None and (not isinstance(frequencies, torch.Tensor) or frequencies.dim() != 2
                                    or frequencies.shape[0] != len(moe_blocks)):
        shape = tuple(frequencies.shape) if isinstance(frequencies, torch.Tensor) else type(frequencies).__name__
        raise ValueError(f"frequencies: expected [MoE layers={len(moe_blocks)}, experts], got {shape}")
    if calibration is not None and frequencies is None:
        with torch.no_grad():
            model(calibration)
    out, root = {}, _model_folder(folder)
    for i, block in enumerate(model.layers):
        if isinstance(block.ffn, LatentMoE):
            layer = block.ffn
            if frequencies is not None:
                chosen = hot_experts(frequencies[moe_blocks.index(i)], hot)
            else:
                chosen = hot_experts(layer.last_expert_counts, hot) if calibration is not None else list(range(hot))
            layer.experts = OffloadedExperts(layer.experts, chosen, root / f"layer_{i}",
                                             ExpertCache(capacity, policy))
            out[i] = layer.experts
    return out


def offload_stats(layers: dict[int, OffloadedExperts], steps: int) -> dict:
    """Over the offloaded layers: hit_rate (expert uses served without a disk read: resident or cached)
    and bytes_per_step read from disk, over `steps` forwards."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: must be a positive integer, got {steps!r}")
    served = sum(m.resident_uses + m.cache.hits for m in layers.values())
    misses = sum(m.cache.misses for m in layers.values())
    return {"hit_rate": served / (served + misses) if served + misses else 1.0,
            "bytes_per_step": sum(m.bytes_read for m in layers.values()) / steps}


def dispatch_with_offload(model: nn.Module, device_map: dict, offload_dir: str | Path) -> nn.Module:
    """accelerate.dispatch_model: blocks mapped to "disk" keep their weights in `offload_dir` and are
    loaded for each forward; "cpu" / device entries stay resident there. The weights go to a new
    subfolder `<offload_dir>/model-XXXXXXXX`, so models offloaded to one folder keep their own.

    A block loads all its weights when it starts (preload): the layers read some submodule weights
    directly (router, W_kvb) rather than by calling the submodule, which per-module hooks would miss.
    """
    from accelerate import dispatch_model

    main = next((d for d in device_map.values() if d not in ("cpu", "disk")), "cpu")
    big_modeling_log = logging.getLogger("accelerate.big_modeling")
    level = big_modeling_log.level
    big_modeling_log.setLevel(logging.ERROR)  # "parameters are on the meta device": offloading them is the point
    try:
        return dispatch_model(model, device_map=device_map, main_device=main,
                              offload_dir=str(_model_folder(offload_dir)), preload_module_classes=["DecoderBlock"])
    finally:
        big_modeling_log.setLevel(level)
