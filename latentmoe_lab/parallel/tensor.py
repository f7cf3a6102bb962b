"""Tensor parallelism: heads and intermediate widths split over the tp group (column in, row out).

Each sharded module is a plain single-device module built for the local width (the config with
num_heads / tp, or the SwiGLU with intermediate / tp) and loaded with slices of the full
weights, so the layer code and its math stay untouched:

    column-parallel (split output rows):  q/k/v/b/f_up/g projections, W_qb, W_kvb, W_gate, W1, W3
    row-parallel (split input columns):   o_proj, W_o, W2        -> partial sums, summed over tp
    replicated:                           low-rank down projections (f_down, W_qa, W_kva), norms,
                                          the DSA lightning indexer (cheap, and its top-k must agree)

Index sharing (dsa.index_share_every > 1) keeps its roles: a sharded source records its selections into a
SharedSelection of this rank, and the sharded layers after it that reuse them (no indexer to load) replay it.

`TensorParallel` wraps such a module and completes its partial output: an all-reduce, or with
sequence parallelism an all-gather of the input sequence and a reduce-scatter of the output.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.dsa_indexer import SharedSelection
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.sequence import SequenceLayout, gather_sequence, reduce_scatter_sequence

ROWS, COLS, FULL = "rows", "cols", "full"


def split(tensor: torch.Tensor, dim: int, index: int, parts: int, sections: list[int] | None = None) -> torch.Tensor:
    """The index-th of `parts` equal slices along `dim`, taken inside each of `sections` when given.

    sections: sizes of concatenated blocks along dim (e.g. q | k | v channels, gate | up columns);
    every block is split on its own so each rank keeps the matching slice of each block.
    """
    blocks = tensor.split(sections, dim) if sections else (tensor,)
    pieces = []
    for block in blocks:
        if block.shape[dim] % parts:
            raise ValueError(f"tp: {parts} must divide a dimension of size {block.shape[dim]}")
        size = block.shape[dim] // parts
        pieces.append(block.narrow(dim, index * size, size))
    return torch.cat(pieces, dim).clone() if len(pieces) > 1 else pieces[0].clone()


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of one TP rank's attention: KDA and MLA head counts divided by tp."""
    kda = dataclasses.asdict(config.kda) | {"num_heads": config.kda.num_heads // tp}
    mla = dataclasses.asdict(config.mla) | {"num_heads": config.mla.num_heads // tp}
    return config.replace(kda=kda, mla=mla)


def _load_slices(local: nn.Module, full: nn.Module, rules: dict[str, tuple], index: int, parts: int) -> nn.Module:
    """Fill `local` with slices of `full`'s tensors; rules: name -> (ROWS|COLS|FULL[, sections])."""
    state = {}
    for name, tensor in full.state_dict().items():
        kind, *sections = rules.get(name, (FULL,))
        if kind == FULL:
            state[name] = tensor.clone()
        else:
            state[name] = split(tensor, 0 if kind == ROWS else 1, index, parts, sections[0] if sections else None)
    local.load_state_dict(state, strict=True)
    return local.to(next(full.parameters()).dtype)


def shard_kda(attn: KimiDeltaAttention, config: ModelConfig, index: int, parts: int) -> KimiDeltaAttention:
    """KDA with heads [index*H/parts, (index+1)*H/parts) of `attn`; o_proj gives a partial sum."""
    key_width = attn.num_heads * attn.head_dim_k
    value_width = attn.num_heads * attn.head_dim_v
    rules = {"q_proj.weight": (ROWS,), "k_proj.weight": (ROWS,), "v_proj.weight": (ROWS,),
             "conv.weight": (ROWS, [key_width, key_width, value_width]), "b_proj.weight": (ROWS,),
             "f_up.weight": (ROWS,), "A_log": (ROWS,), "dt_bias": (ROWS,), "o_proj.weight": (COLS,)}
    if isinstance(attn.g_proj, nn.Linear):
        rules["g_proj.weight"] = (ROWS,)
    else:  # low-rank output gate: the down half stays whole
        rules["g_proj.1.weight"] = (ROWS,)
    return _load_slices(KimiDeltaAttention(local_config(config, parts)), attn, rules, index, parts)


def shard_dsa(attn: GatedDSA, config: ModelConfig, index: int, parts: int,
              selections: dict[int, SharedSelection] | None = None) -> GatedDSA:
    """Gated DSA with a 1/parts slice of the MLA heads; latent, rope key and indexer stay whole.

    A layer that shares selections (dsa.index_share_every > 1) keeps its role: selections maps a source layer
    to this rank's SharedSelection, filled in by the first call that needs it, so a source and its reusers
    sharded with the same dict (in layer order) are linked as in the model. A reuser has no indexer to load;
    sharded without its source, it raises at its first forward (nothing recorded for it to replay).
    """
    local = GatedDSA(local_config(config, parts))
    if attn.selection_role != "own":
        source = attn.shared_selection.source_layer
        shared = (selections if selections is not None else {}).setdefault(source, SharedSelection(source))
        local.share_selection(shared, attn.selection_role)
    rules = {"wq_b.weight": (ROWS,), "wkv_b.weight": (ROWS,), "w_gate.weight": (ROWS,), "wo.weight": (COLS,)}
    return _load_slices(local, attn, rules, index, parts)


def shard_swiglu(ffn: SwiGLU, index: int, parts: int) -> SwiGLU:
    """SwiGLU with a 1/parts slice of the intermediate width; w2 gives a partial sum."""
    local = SwiGLU(ffn.hidden, ffn.w1.out_features // parts, ffn.activation_clamp, ffn.situ_betas)
    rules = {"w1.weight": (ROWS,), "w3.weight": (ROWS,), "w2.weight": (COLS,)}
    return _load_slices(local, ffn, rules, index, parts)


def shard_experts(experts: LatentExperts, first: int, count: int, index: int, parts: int) -> LatentExperts:
    """Experts [first, first + count) with a 1/parts slice of their intermediate width.

    w13 [E, latent, 2*inter] keeps the matching columns of both its gate and up halves;
    w2 [E, inter, latent] the matching rows. The output is a partial sum over the tp group.
    """
    num_experts, latent, double_inter = experts.w13.shape
    if not (0 <= first and count >= 1 and first + count <= num_experts):
        raise ValueError(f"first, count: experts [{first}, {first + count}) must lie in [0, {num_experts})")
    inter = double_inter // 2
    local = LatentExperts(count, latent, inter // parts, experts.activation_clamp, experts.situ_betas)
    with torch.no_grad():
        local.w13.copy_(split(experts.w13[first:first + count], 2, index, parts, [inter, inter]))
        local.w2.copy_(split(experts.w2[first:first + count], 1, index, parts))
    return local.to(experts.w13.dtype)


class TensorParallel(nn.Module):
    """Completes a TP-sharded module's partial output over the tp group.

    forward(x [B, T, D], *args, **kwargs) -> [B, T, D] (all-reduce), or with layout.sequence_parallel
    x [B, T/tp, D] -> gathered to [B, T, D] -> module -> reduce-scattered to [B, T/tp, D].
    """

    def __init__(self, inner: nn.Module, comm: Comm, layout: SequenceLayout, tag: str):
        super().__init__()
        self.inner, self.comm, self.layout, self.tag = inner, comm, layout, tag

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.layout.sequence_parallel:
            x = gather_sequence(self.comm, x, "tp", "sp.gather")
            return reduce_scatter_sequence(self.comm, self.inner(x, *args, **kwargs), "tp", self.tag)
        return self.comm.all_reduce(self.inner(x, *args, **kwargs), "tp", self.tag)
