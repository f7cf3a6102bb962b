"""A request's rows from a parallel engine's worker processes, in whole-model layout (docs/design.md §13.1).

How serving ranks hold the pools (parallel_worker.py, parallel/tensor.py): a pipeline stage's ranks hold
its layers only; within a stage, tensor-parallel rank t holds KDA heads [t*H/tp, (t+1)*H/tp) of every
KDA layer, and every rank holds the whole DSA latent and indexer rows (they are replicated). So:

    DSA rows     taken from the stage's tp rank 0 (the other ranks' copies must be byte-identical)
    KDA state    [L, H/tp, d_k, d_v] per rank -> concatenated along the heads -> [L, H, d_k, d_v]
    KDA conv     [L, (H/tp) * (2 d_k + d_v), K-1] per rank, channels q | k | v of its heads each ->
                 the q parts of all ranks, then the k parts, then the v parts -> [L, H * (2 d_k + d_v), K-1]
    stages       their layers concatenated in order

Expert-parallel ranks hold whole attention heads and replicated pools, so ep index 0 is read.
"""
from __future__ import annotations

import torch

from latentmoe_lab.parallel.mesh import coords_rank


def read_rows_from_workers(engine, positions: torch.Tensor, slot: int) -> dict[str, torch.Tensor]:
    """The rows read_request_rows gives in one process, gathered from engine.runner's worker group."""
    runner = engine.runner
    pconfig, kda = runner.pconfig, engine.model_config.kda
    ranks = runner.group.read_rows(positions.tolist(), slot)
    stages = []
    for stage in range(pconfig.pp):
        members = [ranks[coords_rank(pconfig, {"pp": stage, "tp": t})] for t in range(pconfig.tp)]
        stages.append(_gather_stage(members, kda.head_dim_k, kda.head_dim_v))
    return {name: torch.cat([stage[name] for stage in stages]) for name in stages[0]}


def _gather_stage(members: list[dict[str, torch.Tensor]], head_dim_k: int, head_dim_v: int) -> dict[str, torch.Tensor]:
    """One stage's tp ranks' rows (tp order) -> the stage's rows with whole heads."""
    first = members[0]
    for index, member in enumerate(members[1:], start=1):
        for name in ("dsa_latent", "dsa_index"):
            if not torch.equal(member[name], first[name]):
                raise RuntimeError(f"{name}: tp rank {index} holds other rows than tp rank 0 (they are replicated)")
    local_heads = first["kda_state"].shape[1]
    widths = [local_heads * head_dim_k, local_heads * head_dim_k, local_heads * head_dim_v]
    conv_parts = [member["kda_conv"].split(widths, dim=1) for member in members]  # per rank: (q, k, v)
    conv = torch.cat([torch.cat([parts[p] for parts in conv_parts], dim=1) for p in range(3)], dim=1)
    return {"dsa_latent": first["dsa_latent"], "dsa_index": first["dsa_index"],
            "kda_state": torch.cat([member["kda_state"] for member in members], dim=1), "kda_conv": conv}
