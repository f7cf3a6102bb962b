"""The training steps bench_train.py and its races time and train: mini's (`latentmoe-lab train`'s step on one
process) and a dense reference's, each with fused AdamW and a LambdaLR schedule, from seed 0."""
from __future__ import annotations

from collections.abc import Callable

import torch
from bench_train_parts import DenseCausalLM

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.training.lm import warmup_cosine

DENSE_LR = 1e-3  # the dense references' peak learning rate (mini's is the train preset's 3e-3); not tuned


def mini_trainer(config: ModelConfig, lr: float, warmup: int, total_steps: int, lr_factor=None):
    """(model, step(ids) -> loss): the train loop's step on one process (training/lm.py), without accelerate.
    lr_factor: the scheduler's multiplier (default: warm-up + cosine over total_steps, as `train`)."""
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor or warmup_cosine(warmup, total_steps, 0.1))
    moe_layers = [block.ffn for block in model.layers if isinstance(block.ffn, LatentMoE)]

    def step(ids: torch.Tensor) -> float:
        output = model(ids, labels=ids)
        total = output.loss + output.aux_loss
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (torch.isfinite(total.detach()) and torch.isfinite(grad_norm)):
            raise FloatingPointError("non-finite loss or gradient norm")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in moe_layers:
            layer.update_bias(layer.last_expert_counts)
        return float(output.loss.detach())

    return model, step


def dense_trainer(build: Callable[[], DenseCausalLM], lr: float, warmup: int, total_steps: int, lr_factor=None):
    """(model, step(ids) -> loss) for the dense model build() makes after seeding 0: AdamW (betas 0.9 / 0.95,
    weight decay 0.1 on every parameter), gradient clipping at 1, warm-up + cosine unless lr_factor."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor or warmup_cosine(warmup, total_steps, 0.1))

    def step(ids: torch.Tensor) -> float:
        loss = model.loss(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return model, step
