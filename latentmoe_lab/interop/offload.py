"""Routed experts left on disk in the transformers checkpoint itself, behind one bounded expert cache
(docs/design.md §17): what runs a checkpoint larger than the machine's memory.

load_with_experts_on_disk loads everything but the routed experts as load.load_transformers does, and gives every
MoE layer a CheckpointExperts in place of its LatentExperts. A forward reads each expert a token routes to from
the memory-mapped safetensors (mapped_files.py: one owned copy, the mapping's pages dropped) into an
ExpertCache (parallel/offload.py's LRU / LFU) shared by all layers and bounded in bytes, then runs the layer's
own expert code on each expert's weights (functional_call), so the logits equal the fully loaded model's.
The checkpoint's files stay mapped as long as the model lives.

Each cached expert lives in its own anonymous memory mapping (`_own_pages`), not in the C allocator's heap:
glibc raises its mmap threshold to the size of the first large block freed, after which expert-sized blocks
come from the heap, and an evicted expert's block stays resident in the heap instead of going back to the
system. Measured (1.65 GB checkpoint, 0.25 GB cache, 32-token prefill): 0.25 GB of free heap resident beside
the cache before, 0.01 GB after (benchmarks/RESULTS.md, bench_load).
"""
from __future__ import annotations

import mmap
import math
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from latentmoe_lab.interop.load import load_mapped
from latentmoe_lab.interop.mapped_files import MappedFiles
from latentmoe_lab.interop.names import TensorMapping, their_views
from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.parallel.offload import ExpertCache


class CheckpointExperts(nn.Module):
    """Drop-in for LatentExperts whose weights stay in the checkpoint: forward(z_perm [M, latent], counts [E]).

    w13 / w2: the name-table entries of this layer's stacked experts; shapes: ours, [E, in, 2*inter] and
    [E, inter, out]. Expert e is read on its first use and kept while `cache` holds it.
    """

    def __init__(self, layer: int, w13: TensorMapping, w2: TensorMapping, shapes, dtype: torch.dtype,
                 mapped: MappedFiles, names: dict[str, str], cache: ExpertCache, template: LatentExperts):
        super().__init__()
        self.layer, self.entries, self.dtype = layer, (w13, w2), dtype
        self.num_experts = shapes[0][0]
        self.expert_shapes = (shapes[0][1:], shapes[1][1:])
        self.mapped, self.names, self.cache = mapped, names, cache
        object.__setattr__(self, "template", template)  # meta weights: kept out of state_dict and .to()
        self.bytes_read = 0

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [in, 2*inter], w2 [inter, out]) of expert e, from the cache or read from the checkpoint."""
        def load():
            weights = []
            for entry, shape in zip(self.entries, self.expert_shapes):
                one = _own_pages((1, *shape), self.dtype)
                per = len(entry.theirs) // self.num_experts  # 2 (gate, up) for w13, 1 for w2
                theirs = tuple(entry.theirs[k * self.num_experts + e] for k in range(per))
                for name, view in zip(theirs, their_views(TensorMapping(entry.ours, theirs, entry.kind), one)):
                    self.mapped.read(self.names[name], out=view)
                self.bytes_read += one.numel() * one.element_size()
                weights.append(one[0])
            return tuple(weights)
        return self.cache.get((self.layer, e), load)

    def forward(self, z_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if counts.dim() != 1 or counts.shape[0] != self.num_experts:
            raise ValueError(f"counts: expected shape ({self.num_experts},) [E], got {tuple(counts.shape)}")
        out = z_perm.new_zeros(z_perm.shape)
        # one expert at a time, on its cached weights as they are (a [1, ...] view, no copy): nothing is held
        # beside the cache but one expert's rows. Stacking a group of experts first cost a copy of the group
        # (hundreds of MB beside a 1 GB cache) and was slower (benchmarks/RESULTS.md, bench_load).
        # z_perm is expert-major, so expert e's rows follow those of experts 0 .. e-1.
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                w13, w2 = self.expert(e)
                out[start:start + count] = functional_call(self.template, {"w13": w13[None], "w2": w2[None]},
                                                           (z_perm[start:start + count], counts[e:e + 1]))
            start += count
        return out


def load_with_experts_on_disk(model_class: type, path: str | Path, cache_bytes: int,
                              dtype: torch.dtype | None = None, policy: str = "lru") -> tuple[nn.Module, ExpertCache]:
    """(model, its expert cache): the transformers checkpoint at `path` with every routed expert left in the
    files, at most `cache_bytes` of them in memory at a time (at least one expert)."""
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 1:
        raise ValueError(f"cache_bytes: must be a positive number of bytes, got {cache_bytes!r}")
    model, (mapped, names, table) = load_mapped(model_class, path, dtype, keep_on_disk=_is_routed_expert)
    entries = {entry.ours: entry for entry in table}
    moe = [(i, block.ffn) for i, block in enumerate(model.layers) if isinstance(block.ffn, LatentMoE)]
    if not moe:
        raise ValueError(f"path: {path} has no MoE layers; load it with from_pretrained")
    ref = moe[0][1].experts
    expert_bytes = (ref.w13[0].numel() + ref.w2[0].numel()) * (dtype or torch.get_default_dtype()).itemsize
    cache = ExpertCache(max(1, cache_bytes // expert_bytes), policy)
    for i, layer in moe:
        with torch.device("meta"):
            template = LatentExperts(1, layer.experts.w13.shape[1], layer.experts.w2.shape[1],
                                     layer.experts.activation_clamp, layer.experts.situ_betas)
        prefix = f"layers.{i}.ffn.experts."
        layer.experts = CheckpointExperts(i, entries[prefix + "w13"], entries[prefix + "w2"],
                                          (tuple(layer.experts.w13.shape), tuple(layer.experts.w2.shape)),
                                          dtype or torch.get_default_dtype(), mapped, names, cache, template)
    return model, cache


def _own_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of `shape` in its own anonymous mapping, unmapped when the tensor (and every view
    of it) is gone: an evicted expert's pages go back to the system at once (module docstring)."""
    numel = math.prod(shape)
    pages = mmap.mmap(-1, max(1, numel * dtype.itemsize), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def _is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name
