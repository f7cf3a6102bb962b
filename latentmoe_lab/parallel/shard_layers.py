"""The TP / EP / EPLB loop over a rank's decoder layers, shared by parallel/sharded.py (parallelize: training
and generation on a mesh) and the serving workers (serving/workers/parallel_worker.py).

For each block, in place:
  attention   tp > 1: head-sliced (shard_kda / shard_dsa), wrapped in TensorParallel to complete its partial
              sums; `around_attention` may wrap it first (context parallelism, parallelize only)
  dense FFN   tp > 1: width-sliced SwiGLU in TensorParallel
  MoE         this rank's experts (intermediate width / tp) behind the All-to-All dispatcher, in ParallelMoE;
              with an EPLB `placement` [MoE layers, P] this rank's P / ep slots instead (parallel/eplb/
              online.py); the shared experts width-sliced under tp, in their own layout (the MoE wrapper has
              already gathered the sequence)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from latentmoe_lab.config import KDA
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.eplb.online import replicate_layer
from latentmoe_lab.parallel.expert import AllToAllDispatcher, ParallelMoE, expert_range
from latentmoe_lab.parallel.sequence import SequenceLayout
from latentmoe_lab.parallel.tensor import TensorParallel, shard_dsa, shard_experts, shard_kda, shard_swiglu


def shard_layers(blocks: Iterable[tuple[int, nn.Module]], config, comm: Comm, layout: SequenceLayout,
                 placement: torch.Tensor | None = None, moe_always: bool = False,
                 around_attention: Callable[[nn.Module, nn.Module], nn.Module] | None = None) -> dict[int, object]:
    """Shard (global layer index, block) pairs of `config`'s model in place for this rank of comm.mesh.

    layout: the SequenceLayout the wrappers share; moe_always: wrap every MoE in ParallelMoE even when neither
    ep nor tp splits it (the serving workers read their routed pairs from its dispatcher); around_attention
    (attention, block) -> the attention to wrap. -> {MoE layer position: ExpertSlots} with a placement, else {}.
    """
    mesh, pconfig = comm.mesh, comm.mesh.pconfig
    tp, tp_index = pconfig.tp, mesh.index("tp")
    experts = expert_range(config.moe.num_experts, pconfig.ep, mesh.index("ep"))
    slots, selections = {}, {}  # selections: this rank's SharedSelection per index source layer
    for index, block in blocks:
        attn = block.attn
        if tp > 1:
            attn = shard_kda(attn, config, tp_index, tp) if block.attention_type == KDA else shard_dsa(
                attn, config, tp_index, tp, selections)
        if around_attention is not None:
            attn = around_attention(attn, block)
        block.attn = TensorParallel(attn, comm, layout, "tp.attn") if tp > 1 else attn
        if not block.is_moe:
            if tp > 1:
                block.ffn = TensorParallel(shard_swiglu(block.ffn, tp_index, tp), comm, layout, "tp.dense")
            continue
        if not (moe_always or pconfig.ep > 1 or tp > 1):
            continue
        layer = block.ffn
        if placement is None:
            layer.experts = shard_experts(layer.experts, experts.start, len(experts), tp_index, tp)
            dispatcher = AllToAllDispatcher(comm, config.moe.num_experts)
        else:
            position = sum(config.is_moe_layer(i) for i in range(index))
            slots[position], dispatcher = replicate_layer(layer, placement[position], comm)
        if layer.shared is not None and tp > 1:
            layer.shared = TensorParallel(shard_swiglu(layer.shared, tp_index, tp), comm, SequenceLayout(),
                                          "tp.moe_shared")
        block.ffn = ParallelMoE(layer, dispatcher, comm, layout, pconfig.overlap)
    return slots
