"""Context parallelism for a long prefill: the sequence is split over the cp group, shard i on member i.

KDA (linear attention). Rank i runs its shard starting from what rank i-1 ended with -- the
short-conv tail and the fp32 recurrent state, i.e. exactly a `KDALayerCache` -- received by
send/recv, and passes its own end state on. That is the single-device recurrence cut into
pieces, so the outputs are equal; ranks form a wavefront (rank i-1 moves on to its next layer
while rank i runs this one).

Gated DSA. Queries of shard i attend over keys 0 .. end of shard i. Each rank computes the
cache entries of its own tokens (latent c_kv, rope key, index key) and all-gathers them over
the cp group; the layer then sees a cache whose length is the shard's start, so its causal
offset is the global position. The gathered entries are what the decode steps attend over.

After a prefill with a cache, every cp rank holds the full state (KDA state broadcast from the
last rank, DSA entries gathered), so decode steps (one token) run replicated on the cp group.
"""
from __future__ import annotations

import torch
from torch import nn

from latentmoe_lab.cache import DSALayerCache, KDALayerCache
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.parallel.comm import Comm, PendingTensor
from latentmoe_lab.parallel.sequence import SequenceLayout, gather_sequence


class ContextParallelKDA(nn.Module):
    """forward(x [B, T_shard, hidden], cache) -> [B, T_shard, hidden]; hands the KDA state rank to rank."""

    def __init__(self, inner: KimiDeltaAttention, comm: Comm, layout: SequenceLayout,
                 pending_sends: list[PendingTensor]):
        super().__init__()
        self.inner, self.comm, self.layout, self.pending_sends = inner, comm, layout, pending_sends
        self.conv_shape = (inner.conv_channels, inner.conv_kernel - 1)
        self.state_shape = (inner.num_heads, inner.head_dim_k, inner.head_dim_v)

    def forward(self, x: torch.Tensor, cache: KDALayerCache | None = None, **kwargs) -> torch.Tensor:
        if not self.layout.context_split:
            return self.inner(x, cache, **kwargs)
        _refuse_packed(kwargs)
        mesh, batch = self.comm.mesh, x.shape[0]
        index, parts = mesh.index("cp"), mesh.size("cp")
        handoff = KDALayerCache()
        state_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # the KDA ops' state dtype
        if index > 0:
            src = mesh.peer("cp", index - 1)
            handoff.conv_state = self.comm.recv((batch, *self.conv_shape), x.dtype, src, "cp.kda_conv")
            handoff.recurrent_state = self.comm.recv((batch, *self.state_shape), state_dtype, src, "cp.kda_state")
        out = self.inner(x, handoff, **kwargs)
        if index < parts - 1:
            dst = mesh.peer("cp", index + 1)
            self.pending_sends.append(self.comm.send(handoff.conv_state, dst, "cp.kda_conv"))
            self.pending_sends.append(self.comm.send(handoff.recurrent_state, dst, "cp.kda_state"))
        if cache is not None:  # decode continues from the end of the whole prefill on every cp rank
            last = index == parts - 1
            conv = handoff.conv_state if last else x.new_empty(batch, *self.conv_shape)
            state = handoff.recurrent_state if last else x.new_empty(batch, *self.state_shape, dtype=state_dtype)
            cache.conv_state = self.comm.broadcast(conv.contiguous(), parts - 1, "cp", "cp.kda_broadcast")
            cache.recurrent_state = self.comm.broadcast(state.contiguous(), parts - 1, "cp", "cp.kda_broadcast")
        return out


class GatheringDSACache(DSALayerCache):
    """A prefill cache for one cp shard starting at global position `start`.

    Before the layer appends, `length` reports `start` (the layer's causal offset). `append`
    all-gathers every shard's entries over cp and keeps keys 0 .. start + T_shard for attention;
    `full` holds the whole gathered sequence for a decode cache.
    """

    def __init__(self, comm: Comm, start: int, placeholder: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        super().__init__(*placeholder)  # empty [B, 0, *] tensors: the layer checks the batch size
        self.comm, self.start, self.gathered = comm, start, False
        self.full: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return self.latent.shape[1] if self.gathered else self.start

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor, index_keys: torch.Tensor) -> None:
        end = self.start + latent.shape[1]
        self.full = tuple(gather_sequence(self.comm, t.contiguous(), "cp", f"cp.dsa_{name}")
                          for t, name in ((latent, "latent"), (k_rope, "rope"), (index_keys, "index")))
        self.latent, self.k_rope, self.index_keys = (t[:, :end] for t in self.full)
        self.gathered = True


class ContextParallelDSA(nn.Module):
    """forward(x [B, T_shard, hidden], cache) -> [B, T_shard, hidden]; gathers latent and index keys."""

    def __init__(self, inner: GatedDSA, comm: Comm, layout: SequenceLayout):
        super().__init__()
        self.inner, self.comm, self.layout = inner, comm, layout
        # a layer reusing another's selections (dsa.index_share_every) has no indexer and caches no index keys
        self.entry_dims = (inner.kv_lora_rank, inner.rope_dim, 0 if inner.indexer is None else inner.indexer.head_dim)

    def forward(self, x: torch.Tensor, cache: DSALayerCache | None = None, **kwargs) -> torch.Tensor:
        if not self.layout.context_split:
            return self.inner(x, cache, **kwargs)
        _refuse_packed(kwargs)
        if cache is not None and cache.length:
            raise ValueError("cache: a context-parallel prefill must start from an empty cache")
        start = self.comm.mesh.index("cp") * x.shape[1]
        placeholder = tuple(x.new_zeros(x.shape[0], 0, dim) for dim in self.entry_dims)
        gathering = GatheringDSACache(self.comm, start, placeholder)
        out = self.inner(x, gathering, **kwargs)
        if cache is not None:
            cache.append(*gathering.full)
        return out


def _refuse_packed(kwargs: dict) -> None:
    if kwargs.get("sequence_start") is not None:
        raise ValueError("sequence_start: packed sequences are not split across context-parallel ranks; "
                         "run them with cp = 1")
