"""Sequence sharding shared by context parallelism (CP) and sequence parallelism (SP).

`SequenceLayout` is one small mutable object that the runtime flips per forward and every
wrapper reads: a CP prefill splits the sequence over the cp group; SP keeps the residual stream
split over the tp group between the tensor-parallel regions. A decode step (T = 1) is never split.

Shapes: x is [B, T, D]; a shard along T is [B, T / n, D], shard i covering rows i*T/n .. (i+1)*T/n.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from latentmoe_lab.parallel.comm import Comm


@dataclass
class SequenceLayout:
    """context_split: this forward's tokens are a cp shard of a longer prefill.
    sequence_parallel: the residual stream is split over tp between TP regions in this forward."""

    context_split: bool = False
    sequence_parallel: bool = False


def shard_sequence(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """[B, T, ...] -> the index-th of `parts` equal slices along T."""
    if x.shape[1] % parts:
        raise ValueError(f"x: sequence length {x.shape[1]} must be divisible by {parts}")
    size = x.shape[1] // parts
    return x[:, index * size:(index + 1) * size]


def gather_sequence(comm: Comm, x: torch.Tensor, dim: str, tag: str) -> torch.Tensor:
    """All-gather shards [B, t, ...] along T over the `dim` group -> [B, n*t, ...] in member order."""
    if comm.mesh.size(dim) == 1:
        return x
    gathered = comm.all_gather(rearrange(x, "b t ... -> t b ...").contiguous(), dim, tag)
    return rearrange(gathered, "t b ... -> b t ...")


def reduce_scatter_sequence(comm: Comm, x: torch.Tensor, dim: str, tag: str) -> torch.Tensor:
    """Partial sums [B, T, D] on each member -> this member's T-slice of the sum, [B, T/n, D].

    Built on all_to_all (gloo has no reduce-scatter): slice j goes to member j, which sums what
    it receives. Same bytes on the wire as a ring reduce-scatter: (n - 1) / n of the tensor.
    """
    parts = comm.mesh.size(dim)
    if parts == 1:
        return x
    batch, seq_len = x.shape[:2]
    rows = rearrange(x, "b (n t) d -> (n b t) d", n=parts)
    block = batch * seq_len // parts
    received = comm.all_to_all(rows, [block] * parts, [block] * parts, dim, tag).wait()
    summed = rearrange(received.float(), "(n b t) d -> n b t d", n=parts, b=batch).sum(0)
    return summed.to(x.dtype)
