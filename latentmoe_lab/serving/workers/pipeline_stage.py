"""Pipeline-parallel serving: each stage's ranks run their layers of the paged forward (docs/design.md §10).

    stage 0          embeds batch.input_ids, merges the image features, runs its layers, sends x on
    stage s          receives x [1, T, hidden] and the finite flags so far from stage s - 1, runs its layers
                     (with Block AttnRes x is the stream, sent packed: [S, 1, T, hidden], S = blocks + partial
                     sum at the cut, parallel/pipeline.activation_width; nothing of it outlives the step)
    last stage       then the final norm and the LM head at each sequence's last new token -> logits [S, vocab],
                     and with batch.hidden_index those rows of x, before the norm (the MTP drafter's input)

A rank sends to and receives from the rank of the next / previous stage with its own tp and ep
coordinates (point-to-point on gloo, the group timeout on every receive); inside a stage TP and EP
work as without pipelining, so every rank of a stage holds the same x.

Layers split into contiguous stages by parallel/pipeline.py's partition_layers (balanced by active
parameters per token, the LM head counted on the last stage). Every rank still receives the whole
ForwardBatch: the stages' pools are indexed by the same block tables and KDA slots, each holding only
its own layers. So one rank's plan is its stage's layers with the KDA heads / tp (plan_stages), and
every stage gets the block count of the most demanding one.

One step is in flight at a time, so a step passes the stages in turn and each stage idles while the
others compute: a (pp - 1) / pp bubble. vLLM fills it with several batches in flight ("virtual
engines"); that is not done here. A stage's receive waits for the stages before it, so that wait
counts as its collective time, and one stage's part of a step must finish within the group timeout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.finite import all_finite
from latentmoe_lab.layers.attn_res import AttnResStream, stream_tensor
from latentmoe_lab.model import CausalLMOutput
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.pipeline import activation_width, partition_layers
from latentmoe_lab.serving.planner import CachePlan, plan_cache


@dataclass(frozen=True)
class ServingStage:
    """One pipeline stage: its decoder layers, and the cache plan of each of its ranks."""

    layers: range
    plan: CachePlan  # the stage's layers with KDA / MLA heads / tp; num_blocks equal on every stage


def stage_config(config: ModelConfig, layers: range, tp: int) -> ModelConfig:
    """The cache-shaping part of one device's share: the stage's layer types, KDA / MLA heads / tp. No MTP
    head: it runs in the engine's process, which keeps the hidden rows its drafter starts from."""
    from latentmoe_lab.parallel.tensor import local_config

    local = local_config(config, tp)
    return local.replace(num_layers=len(layers), layer_types=[config.layer_types[i] for i in layers],
                         first_dense_layers=min(config.first_dense_layers, len(layers)), mtp_depth=0)


def plan_stages(config, service, pconfig: ParallelConfig) -> list[ServingStage]:
    """Every stage's layers and one rank's CachePlan, with the fewest blocks any stage can hold: the block
    tables are shared, so every stage must hold every block id the scheduler hands out. A stage without
    DSA layers stores nothing per block (plan_cache then gives it a nominal count): it does not limit."""
    stages = partition_layers(config, pconfig.pp)
    plans = [plan_cache(stage_config(config, layers, pconfig.tp), service) for layers in stages]
    # with memory.offload a stage's blocks cost device bytes (index keys) and host bytes (latent rows)
    limiting = [plan for plan in plans if plan.block_bytes > 0 or plan.host_block_bytes > 0] or plans
    blocks = min(plan.num_blocks for plan in limiting)
    return [ServingStage(layers, dataclasses.replace(plan, num_blocks=blocks)) for layers, plan in zip(stages, plans)]


def keep_stage(model, layers: range, first: bool, last: bool):
    """Cut `model` (this process's own copy) in place to one stage: its layers; the embedding on the first
    stage and the final norm + LM head on the last (a tied head keeps the shared matrix). The vision
    tower runs in the engine process, so no stage keeps it."""
    model.layers = nn.ModuleList(model.layers[i] for i in layers)
    if not first:
        model.embed_tokens = None
    if not last:
        model.norm = model.lm_head = model.attn_res_final = None
    model.vision = None
    return model


class StageForward:
    """This rank's part of one serving step: the whole paged forward (pp 1), or its stage's layers between
    a receive from the previous stage and a send to the next. Returns the CausalLMOutput on the last stage,
    None on the others."""

    def __init__(self, model, comm, layers: range, full_config):
        self.model, self.comm, self.layers, self.config = model, comm, layers, full_config
        mesh = comm.mesh
        self.pp, stage = mesh.pconfig.pp, mesh.index("pp")
        self.prev = None if stage == 0 else mesh.peer("pp", stage - 1)
        self.next = None if stage == self.pp - 1 else mesh.peer("pp", stage + 1)
        self.dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def __call__(self, batch, pools) -> CausalLMOutput | None:
        if self.pp == 1:
            return self.model(batch.input_ids, batch=batch, pools=pools)
        model, comm, config = self.model, self.comm, self.config
        if pools.block_size != batch.block_size:
            raise ValueError(f"batch.block_size: {batch.block_size} differs from the pools' {pools.block_size}")
        batch.check(pools.num_blocks, pools.num_slots, config.max_position_embeddings)
        attn_res = config.attn_res_block_size is not None
        if self.prev is None:
            x = self._embed(batch)
            finite = [all_finite(x)]
            x = AttnResStream.start(x) if attn_res else x
        else:
            shape = (1, batch.num_tokens, config.hidden_size)
            if attn_res:
                shape = (activation_width(config, self.layers.start), *shape)
            x = comm.recv(shape, self.dtype, self.prev, "pp.hidden")
            x = AttnResStream.unpack(x) if attn_res else x
            finite = list(comm.recv((1 + self.layers.start,), torch.uint8, self.prev, "pp.finite").bool())
        for offset, block in enumerate(model.layers):
            x = block(x, batch=batch, pool=pools.layer(offset))
            finite.append(all_finite(stream_tensor(x)))
        if self.next is not None:
            sends = [comm.send(x.pack() if attn_res else x, self.next, "pp.hidden"),
                     comm.send(torch.stack(finite).to(torch.uint8), self.next, "pp.finite")]
            for pending in sends:
                pending.wait()
            return None
        x = model.end_stream(x)  # the final AttnRes mix, or x itself
        last = model.norm(x[:, batch.output_index])  # [1, S, hidden]
        finite.append(all_finite(last))
        hidden = None if batch.hidden_index is None else x[0, batch.hidden_index]  # as the whole model's forward
        return CausalLMOutput(logits=model.lm_head(last).float()[0], finite=torch.stack(finite), hidden=hidden)

    def _embed(self, batch) -> torch.Tensor:
        """Token embeddings [1, T, hidden] with the image placeholders' rows replaced by batch.image_features."""
        x = self.model.embed_tokens(batch.input_ids)
        if batch.image_features is not None or batch.image_mask is not None:
            vision = self.config.vision
            mask = batch.checked_image_mask(None if vision is None else vision.image_token_id,
                                            self.config.hidden_size)
            x = x.masked_scatter(mask[None, :, None], batch.image_features.to(x.dtype))
        return x
