"""Attach a layout to a single-device model from outside: `parallelize(model, comm) -> ShardedCausalLM`.

For this rank (its coordinates on the mesh of `comm`):
  pp  keep the stage's decoder blocks (+ embeddings on the first stage, norm + LM head on the last)
  tp  replace attention / dense FFN / shared experts by head- or width-sliced copies, wrapped to
      complete their partial sums; slice each expert's intermediate width
  ep  keep this rank's experts and swap in the All-to-All dispatcher
  cp  wrap attention to hand KDA states rank to rank and gather DSA cache entries
The blocks keep their own forward; the wrappers only move tensors between ranks. Nothing in the
single-device layers changes, and the original model is left untouched (blocks are copied).

ShardedCausalLM runs one rank's part: `forward` on local ids (the rank's rows, and its sequence
shard in a CP prefill) returns local logits on the last stage; `gather_logits` assembles them, and
`generate` takes the global batch and returns the global tokens on every rank. Text only: the
vision tower is not sharded, and generation is greedy with a fixed number of new tokens (every
rank must take the same steps).
The full model is built on every rank first, then cut: fine for small configs; a full-scale run
would build on the meta device and load each rank's slices from a checkpoint instead.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from latentmoe_lab.cache import HybridCache
from latentmoe_lab.config import KDA
from latentmoe_lab.layers.attn_res import AttnResStream, stream_width
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.comm import Comm, PendingTensor
from latentmoe_lab.parallel.context import ContextParallelDSA, ContextParallelKDA
from latentmoe_lab.parallel.eplb.replicas import check_placement
from latentmoe_lab.parallel.mesh import data_shard
from latentmoe_lab.parallel.pipeline import partition_layers
from latentmoe_lab.parallel.sequence import SequenceLayout, gather_sequence, shard_sequence
from latentmoe_lab.parallel.shard_layers import shard_layers


def parallelize(model: LatentMoEForCausalLM, comm: Comm, placement: torch.Tensor | None = None) -> "ShardedCausalLM":
    """This rank's share of `model` under the layout of `comm.mesh`. placement: an EPLB expert placement
    [MoE layers, P] (phy2log of parallel/eplb/rebalance.py): each MoE layer then holds this rank's P / ep slots and
    sends every (token, expert) pair to one replica (parallel/eplb/online.py); inference only."""
    if not isinstance(model, LatentMoEForCausalLM):
        raise TypeError(f"model: expected a LatentMoEForCausalLM, got {type(model).__name__}")
    mesh, pconfig, config = comm.mesh, comm.mesh.pconfig, model.config
    pconfig.validate_for(config, mesh.pconfig.world_size)
    stages = partition_layers(config, pconfig.pp, model)
    layout, pending_sends = SequenceLayout(), []
    if placement is not None:
        check_placement(placement, sum(map(config.is_moe_layer, range(config.num_layers))), config.moe.num_experts,
                        pconfig.ep)

    def around_attention(attn: nn.Module, block: nn.Module) -> nn.Module:
        if pconfig.cp == 1:
            return attn
        return (ContextParallelKDA(attn, comm, layout, pending_sends) if block.attention_type == KDA
                else ContextParallelDSA(attn, comm, layout))

    stage = stages[mesh.index("pp")]
    # one deepcopy for the stage, so a reusing DSA layer's copy still replays its source copy's selections
    blocks = copy.deepcopy(nn.ModuleList(model.layers[i] for i in stage))
    shard_layers(zip(stage, blocks), config, comm, layout, placement, around_attention=around_attention)
    first, last = mesh.is_first_stage, mesh.is_last_stage
    return ShardedCausalLM(model, comm, stages, blocks, layout, pending_sends,
                           copy.deepcopy(model.embed_tokens) if first else None,
                           copy.deepcopy(model.norm) if last else None,
                           copy.deepcopy(model.lm_head) if last else None)


class ShardedCausalLM(nn.Module):
    """One rank's stage of a LatentMoEForCausalLM; `layer_ids` are the global indices of `blocks`."""

    def __init__(self, model, comm: Comm, stages: list[range], blocks: nn.ModuleList, layout: SequenceLayout,
                 pending_sends: list[PendingTensor], embed_tokens, norm, lm_head):
        super().__init__()
        self.config, self.comm, self.pconfig = model.config, comm, comm.mesh.pconfig
        self.stages, self.layer_ids = stages, list(stages[comm.mesh.index("pp")])
        self.blocks, self.layout, self.pending_sends = blocks, layout, pending_sends
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        # Block AttnRes: stages pass the whole stream, packed [S, b, t, hidden]; the last stage's final mix
        self.attn_res_final = (copy.deepcopy(model.attn_res_final)
                               if lm_head is not None and model.attn_res_final is not None else None)
        self.dtype = next(model.parameters()).dtype
        self.stage_seconds = 0.0

    # ------------------------------------------------------------------ data placement
    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """[B, ...] global rows -> this rank's data shard [B / (dp*ep), ...]."""
        shards = self.pconfig.data_shards
        return batch.chunk(shards)[data_shard(self.pconfig, self.comm.mesh.rank)]

    def local_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Global prompt [B, T] -> this rank's rows and (with cp) its sequence shard."""
        self.pconfig.validate_batch(*input_ids.shape)
        return shard_sequence(self.local_rows(input_ids), self.comm.mesh.index("cp"), self.pconfig.cp)

    # ------------------------------------------------------------------ one stage
    def activation_shape(self, rows: int, length: int) -> tuple[int, ...]:
        """What this stage receives from the previous one: hidden [rows, length, hidden], or with Block AttnRes
        the packed stream [S, rows, length, hidden], S = the blocks + partial sum after the earlier layers."""
        shape = (rows, length, self.config.hidden_size)
        block_size = self.config.attn_res_block_size
        return shape if block_size is None else (stream_width(self.layer_ids[0], block_size), *shape)

    def run_stage(self, x: torch.Tensor, cache: HybridCache | None = None) -> torch.Tensor:
        """First stage: ids [b, t] -> ...; other stages: `activation_shape` (hidden [b, t', hidden], t' = t / tp
        under SP). Last stage returns fp32 logits [b, t, vocab], the others the activation to send on."""
        start = time.perf_counter()
        mesh = self.comm.mesh
        attn_res = self.config.attn_res_block_size is not None
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
            if self.layout.sequence_parallel:
                x = shard_sequence(x, mesh.index("tp"), mesh.size("tp"))
            x = AttnResStream.start(x) if attn_res else x
        elif attn_res:
            x = AttnResStream.unpack(x)
        for i, block in zip(self.layer_ids, self.blocks):
            x = block(x, None if cache is None else cache[i])
        if attn_res:  # the mix is per token: on a sequence-parallel shard as on the whole sequence
            x = self.attn_res_final(x.candidates()) if self.lm_head is not None else x.pack()
        if self.lm_head is not None:
            if self.layout.sequence_parallel:
                x = gather_sequence(self.comm, x, "tp", "sp.gather")
            x = self.lm_head(self.norm(x)).float()
        self.stage_seconds += time.perf_counter() - start
        return x

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None) -> torch.Tensor | None:
        """Local ids [b, t] through every stage -> local logits [b, t, vocab] on the last stage, else None.

        Without a cache the rows run as `micro_batches` pipelined micro-batches. With cp > 1, a forward
        from an empty cache is a context-parallel prefill: `input_ids` is this rank's sequence shard.
        """
        mesh, pconfig, comm = self.comm.mesh, self.pconfig, self.comm
        fresh = cache is None or cache.seq_len == 0
        self.layout.context_split = pconfig.cp > 1 and fresh
        local_len = input_ids.shape[1]
        self.layout.sequence_parallel = (pconfig.sequence_parallel and pconfig.tp > 1
                                         and local_len % pconfig.tp == 0)
        micro = input_ids.chunk(1 if cache is not None else pconfig.micro_batches)
        stage_len = local_len // pconfig.tp if self.layout.sequence_parallel else local_len
        prev_rank = None if mesh.is_first_stage else mesh.peer("pp", mesh.index("pp") - 1)
        next_rank = None if mesh.is_last_stage else mesh.peer("pp", mesh.index("pp") + 1)
        outputs = []
        for ids in micro:
            x = ids if prev_rank is None else comm.recv(self.activation_shape(ids.shape[0], stage_len),
                                                        self.dtype, prev_rank, "pp.act")
            out = self.run_stage(x, cache)
            if next_rank is None:
                outputs.append(out)
            else:
                self.pending_sends.append(comm.send(out, next_rank, "pp.act"))
        for pending in self.pending_sends:
            pending.wait()
        self.pending_sends.clear()
        if cache is not None:
            cache.seq_len += local_len * (pconfig.cp if self.layout.context_split else 1)
        self.layout.context_split = self.layout.sequence_parallel = False
        return torch.cat(outputs) if outputs else None

    # ------------------------------------------------------------------ global results
    def gather_logits(self, local_logits: torch.Tensor | None, rows: int, seq_len: int) -> torch.Tensor:
        """Local logits of a prefill (None off the last stage) -> global [B, T, vocab] on every rank."""
        comm = self.comm
        if local_logits is None:
            local_logits = torch.empty(rows, seq_len, self.config.vocab_size, device=comm.mesh.device)
        logits = comm.broadcast(local_logits.contiguous(), self.pconfig.pp - 1, "pp", "gather.pp")
        logits = gather_sequence(comm, logits, "cp", "gather.cp")
        return comm.all_gather(comm.all_gather(logits, "ep", "gather.ep"), "dp", "gather.dp")

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16) -> torch.Tensor:
        """Greedy decoding of the global batch [B, T] -> [B, T + max_new_tokens] on every rank.

        Prefill (context-parallel with cp > 1), then one token per step through every stage; the
        next token comes from the last stage (last cp rank) and is broadcast along cp and pp.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
        tokens = self.local_rows(input_ids)
        cache = HybridCache(self.config)
        logits = self(self.local_inputs(input_ids), cache) if max_new_tokens else None
        for step in range(max_new_tokens):
            next_token = self._next_token(logits, tokens.shape[0])
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if step < max_new_tokens - 1:
                logits = self(next_token[:, None], cache)
        return self.comm.all_gather(self.comm.all_gather(tokens, "ep", "gather.ep"), "dp", "gather.dp")

    def _next_token(self, logits: torch.Tensor | None, rows: int) -> torch.Tensor:
        mesh = self.comm.mesh
        token = torch.empty(rows, dtype=torch.int64, device=mesh.device)
        if mesh.is_last_stage:
            if mesh.index("cp") == self.pconfig.cp - 1:
                token = logits[:, -1].argmax(dim=-1)
            token = self.comm.broadcast(token, self.pconfig.cp - 1, "cp", "gen.cp")
        return self.comm.broadcast(token, self.pconfig.pp - 1, "pp", "gen.pp")
