"""A request's rows in a parallel engine's worker processes: gathered into, and sliced from, the whole-model
layout a transfer carries (docs/design.md §13.1).

How serving ranks hold the pools (serving/workers/parallel_worker.py, parallel/tensor.py): a pipeline stage's ranks hold
its layers only; within a stage, tensor-parallel rank t holds KDA heads [t*H/tp, (t+1)*H/tp) of every
KDA layer, and every rank holds the whole DSA latent and indexer rows (they are replicated). So:

    DSA rows     taken from the stage's tp rank 0 (the other ranks' copies must be byte-identical);
                 every rank of the stage gets all of them
    KDA state    [L, H/tp, d_k, d_v] per rank <-> concatenated along the heads [L, H, d_k, d_v]
    KDA conv     [L, (H/tp) * (2 d_k + d_v), K-1] per rank, channels q | k | v of its heads each <->
                 the q parts of all ranks, then the k parts, then the v parts [L, H * (2 d_k + d_v), K-1]
                 (memory.state_dtype int8: dim 1 holds groups of G channels, so the parts are widths / G)
    stages       their layers concatenated in order

Expert-parallel ranks hold whole attention heads and replicated pools: ep index 0 is read, all are written.
"""
from __future__ import annotations

import torch

from latentmoe_lab.config import DSA
from latentmoe_lab.parallel.mesh import coords_rank, rank_coords


def gather_ranks(ranks: list[dict[str, torch.Tensor]], pconfig, config) -> dict[str, torch.Tensor]:
    """Every rank's rows (rank order) -> the whole-model rows read_request_rows gives in one process.
    pconfig: the workers' ParallelConfig; config: the whole model's ModelConfig."""
    kda = config.kda
    stages = []
    for stage in range(pconfig.pp):
        members = [ranks[coords_rank(pconfig, {"pp": stage, "tp": t})] for t in range(pconfig.tp)]
        stages.append(gather_heads(members, kda.head_dim_k, kda.head_dim_v))
    return {name: torch.cat([stage[name] for stage in stages]) for name in stages[0]}


def rank_shares(rows: dict[str, torch.Tensor], pconfig, config, stages) -> list[dict[str, torch.Tensor]]:
    """Whole-model rows -> every rank's share (rank order): its stage's layers and its heads. stages: the
    engine's ServingStages (their layers)."""
    shares = []
    for rank in range(pconfig.world_size):
        coords = rank_coords(pconfig, rank)
        parts = stage_parts(config, stages[coords["pp"]].layers)
        stage = {name: rows[name][parts[kind]] for name, kind in (("dsa_latent", "dsa"), ("dsa_index", "indexer"),
                                                                  ("kda_state", "kda"), ("kda_conv", "kda"))}
        shares.append(slice_heads(stage, coords["tp"], pconfig.tp, config.kda.head_dim_k, config.kda.head_dim_v))
    return shares


def stage_parts(config, layers: range) -> dict[str, slice]:
    """Which entries of the whole-model rows a stage's layers hold: {"dsa", "indexer", "kda"} -> slice (the
    DSA layers, those that keep index keys, the KDA layers, each counted in layer order)."""
    kinds = {"dsa": [i for i, t in enumerate(config.layer_types) if t == DSA]}
    kinds["indexer"] = [i for i in kinds["dsa"] if config.dsa.use_indexer and config.index_source(i) == i]
    kinds["kda"] = [i for i, t in enumerate(config.layer_types) if t != DSA]
    return {kind: slice(sum(i < layers.start for i in ids), sum(i < layers.stop for i in ids))
            for kind, ids in kinds.items()}


def _conv_widths(heads: int, head_dim_k: int, head_dim_v: int, conv: torch.Tensor) -> list[int]:
    """The q, k and v parts of conv rows [L, dim 1, ...] of `heads` heads, in dim-1 rows (a stored row holds
    one channel, or one group of channels in a grouped slot format, quant/kda_state.py)."""
    widths = [heads * head_dim_k, heads * head_dim_k, heads * head_dim_v]
    per_row = sum(widths) // conv.shape[1]
    return [width // per_row for width in widths]


def gather_heads(members: list[dict[str, torch.Tensor]], head_dim_k: int, head_dim_v: int) -> dict[str, torch.Tensor]:
    """One stage's tp ranks' rows (tp order) -> the stage's rows with whole heads."""
    first = members[0]
    for index, member in enumerate(members[1:], start=1):
        for name in ("dsa_latent", "dsa_index"):
            if not torch.equal(member[name], first[name]):
                raise RuntimeError(f"{name}: tp rank {index} holds other rows than tp rank 0 (they are replicated)")
    widths = _conv_widths(first["kda_state"].shape[1], head_dim_k, head_dim_v, first["kda_conv"])
    conv_parts = [member["kda_conv"].split(widths, dim=1) for member in members]  # per rank: (q, k, v)
    conv = torch.cat([torch.cat([parts[p] for parts in conv_parts], dim=1) for p in range(3)], dim=1)
    return {"dsa_latent": first["dsa_latent"], "dsa_index": first["dsa_index"],
            "kda_state": torch.cat([member["kda_state"] for member in members], dim=1), "kda_conv": conv}


def slice_heads(rows: dict[str, torch.Tensor], index: int, parts: int, head_dim_k: int,
                head_dim_v: int) -> dict[str, torch.Tensor]:
    """A stage's whole-head rows -> tp rank `index` of `parts`'s share (the inverse of gather_heads)."""
    heads = rows["kda_state"].shape[1]
    if heads % parts:
        raise ValueError(f"parallel.tensor_parallel_size: ({parts}) must divide the KDA heads ({heads})")
    local = heads // parts
    widths = _conv_widths(heads, head_dim_k, head_dim_v, rows["kda_conv"])
    own = [part.chunk(parts, dim=1)[index] for part in rows["kda_conv"].split(widths, dim=1)]
    return {"dsa_latent": rows["dsa_latent"], "dsa_index": rows["dsa_index"],
            "kda_state": rows["kda_state"][:, index * local:(index + 1) * local].contiguous(),
            "kda_conv": torch.cat(own, dim=1).contiguous()}
