"""One training step on torch's engine, for any NativeLayout: the same update as one process on the whole batch.

    rows     the global batch [B, T] is split over "data" (dp_shard x ep); tp ranks share their rows
    forward  model(ids, labels=ids): loss + aux; with pp > 1 a torch.distributed.pipelining
             schedule (GPipe / 1F1B) over micro-batches, the router losses riding on the activations
    grads    FSDP2 averages dense gradients over "data"; an expert's gradient already sums its ep
             group's tokens (the All-to-All backward brings them), so it is divided by ep here;
             under an EPLB placement with replicas, first summed over each expert's replicas
    clip     the global gradient norm over every placement (and every pipeline stage)
    update   AdamW on the DTensor parameters; then the routing-bias update from the expert counts
             summed over "data" (each stage updates its own layers)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.model import causal_lm_loss
from latentmoe_lab.native.build import NativeModel, expert_params
from latentmoe_lab.native.eplb import replica_copies, sum_replica_gradients, unique_square
from latentmoe_lab.native.stage import named_blocks


def local_rows(native: NativeModel, batch: torch.Tensor) -> torch.Tensor:
    """Global rows [B, ...] -> this rank's data shard [B / (dp_shard*ep), ...]."""
    native.layout.validate_batch(batch.shape[0])
    return batch.chunk(native.layout.data_shards)[native.mesh["data"].get_local_rank()]


class ExpertCounts:
    """Sums each MoE layer's routed (token, expert) counts over every forward of a step (micro-batches too)."""

    def __init__(self, module, device: torch.device):
        moe = [(i, block.ffn) for i, block in named_blocks(module) if isinstance(block.ffn, LatentMoE)]
        self.layer_ids = [i for i, _ in moe]
        self.layers = [layer for _, layer in moe]
        self.device = device
        self.totals = [torch.zeros(layer.num_experts, dtype=torch.int64, device=device) for layer in self.layers]
        for layer, total in zip(self.layers, self.totals):
            layer.register_forward_hook(self._adder(total))

    @staticmethod
    def _adder(total: torch.Tensor):
        def add(module, args, output) -> None:  # returns None: the layer's output is left as it is
            # training forwards only: pipelining's shape-inference pass runs the stage once under no_grad
            if module.training and torch.is_grad_enabled():
                total.add_(module.last_expert_counts)
        return add

    def update_biases(self, data_group) -> torch.Tensor:
        """All-reduce the step's counts over the data ranks, update each layer's bias, reset; returns [L, E]."""
        if not self.layers:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        counts = torch.stack(self.totals)
        dist.all_reduce(counts, group=data_group)
        for layer, layer_counts, total in zip(self.layers, counts, self.totals):
            if layer.bias_rule == "quantile":  # the last micro-batch's quantiles, averaged over the data ranks
                bias = layer.target_bias()
                dist.all_reduce(bias, group=data_group)
                layer.set_bias(bias / dist.get_world_size(data_group))
            else:
                layer.update_bias(layer_counts)
            total.zero_()
        return counts


def clip_global_norm(native: NativeModel, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm; returns the norm before clipping."""
    squares = torch.zeros((), dtype=torch.float64, device=native.device)
    copies = replica_copies(native.module)  # replicated expert stacks: each expert's gradient counted once
    for param in native.module.parameters():
        if param.grad is None:
            continue
        if param in copies:
            squares += unique_square(param.grad, copies[param])
        else:
            # at least fp32, fp64 for fp64 gradients (the equivalence checks compare the norm itself)
            norm = torch.linalg.vector_norm(param.grad.to(torch.promote_types(param.grad.dtype, torch.float32)))
            squares += (norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2
    if native.layout.pp > 1:
        dist.all_reduce(squares, group=native.mesh["pp"].get_group())
    total = squares.sqrt()  # fp64, like the squares: an fp32 norm would round the clipping of fp64 weights
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for param in native.module.parameters():
        if param.grad is not None:
            param.grad.mul_(coefficient)
    return total


class NativeTrainer:
    """AdamW training of a NativeModel; `step(batch)` with the global batch [B, T] -> {"loss", "grad_norm", "counts"}.

    counts [L, E]: every MoE layer's (token, expert) counts of the step, summed over the data ranks.
    """

    def __init__(self, native: NativeModel, lr: float = 1e-3, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999)):
        self.native, self.grad_clip = native, grad_clip
        native.reshard()  # the optimizer must hold the sharded parameters, not a gathered copy
        params = list(native.module.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},  # as training/lm.py
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        # foreach=False: the parameters live on several meshes (data, tp, ep), which foreach kernels refuse
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=False)
        self.counts = ExpertCounts(native.module, native.device)
        self.experts = expert_params(native.module)
        self.schedule, self.schedule_shape = None, None

    def step(self, batch: torch.Tensor) -> dict:
        native = self.native
        native.module.train()
        ids = local_rows(native, batch).to(native.device)
        loss = self._forward_backward(ids)
        sum_replica_gradients(native.module)
        if native.layout.ep > 1:
            for param in self.experts:
                if param.grad is not None:
                    param.grad.div_(native.layout.ep)
        grad_norm = clip_global_norm(native, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts = self.counts.update_biases(native.mesh["data"].get_group())
        dist.all_reduce(loss, group=native.mesh["data"].get_group())
        if native.layout.pp > 1:  # every stage reports every MoE layer's counts
            counts = self._all_stage_counts(counts)
        return {"loss": float(loss) / native.layout.data_shards, "grad_norm": float(grad_norm), "counts": counts}

    def _all_stage_counts(self, stage_counts: torch.Tensor) -> torch.Tensor:
        """This stage's [L_stage, E] counts -> [L, E] over all MoE layers of the model (summed over pp)."""
        config = self.native.module.config
        moe_ids = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
        counts = torch.zeros(len(moe_ids), config.moe.num_experts, dtype=torch.int64, device=self.native.device)
        for row, layer_id in zip(stage_counts, self.counts.layer_ids):
            counts[moe_ids.index(layer_id)] = row
        dist.all_reduce(counts, group=self.native.mesh["pp"].get_group())
        return counts

    def _forward_backward(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's CE loss (fp32 scalar, the same on every pipeline stage), after backward."""
        native = self.native
        if native.layout.pp == 1:
            output = native.module(ids, labels=ids)
            (output.loss + output.aux_loss).backward()
            return output.loss.detach().clone()
        if self.schedule_shape != tuple(ids.shape):
            self.schedule, self.schedule_shape = _pipeline_schedule(native, *ids.shape), tuple(ids.shape)
        losses: list[torch.Tensor] = []
        if native.is_first_stage:
            self.schedule.step(ids)
        elif native.is_last_stage:
            self.schedule.step(target=ids, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=native.device)
        pp = native.mesh["pp"]
        dist.broadcast(loss, group=pp.get_group(), group_src=native.layout.pp - 1)
        return loss


def _pipeline_schedule(native: NativeModel, rows: int, seq_len: int):
    """A GPipe / 1F1B schedule over this stage, with static shapes (meta tensors).

    Static metadata, because the dynamic kind runs each stage forward and backward once on
    uninitialised buffers to learn the shapes: NaN into the router's checks, and counts into the
    routing-bias update.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    layout, config = native.layout, native.module.config
    micro = rows // layout.micro_batches
    # requires_grad: what tells a stage that its input's gradient goes back to the previous stage
    hidden = torch.empty(micro, seq_len, config.hidden_size, dtype=native.compute_dtype, device="meta",
                         requires_grad=True)
    ids = torch.empty(micro, seq_len, dtype=torch.int64, device="meta")
    logits = torch.empty(micro, seq_len, config.vocab_size, dtype=torch.float32, device="meta")
    pp = native.mesh["pp"]
    stage = PipelineStage(native.module, pp.get_local_rank(), layout.pp, native.device,
                          input_args=ids if native.is_first_stage else hidden,
                          output_args=logits if native.is_last_stage else hidden,
                          input_grads=None if native.is_first_stage else hidden,
                          output_grads=None if native.is_last_stage else hidden, group=pp.get_group())
    schedule = ScheduleGPipe if layout.schedule == "gpipe" else Schedule1F1B
    return schedule(stage, layout.micro_batches, loss_fn=causal_lm_loss)
