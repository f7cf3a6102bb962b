"""Inference forward of a NativeModel: the global batch in, the global logits out on every rank.

With pp > 1 the stages hand the hidden state on with point-to-point sends over the "pp" dim (a
forward needs no schedule); the last stage's logits are broadcast back along pp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from latentmoe_lab.native.build import NativeModel
from latentmoe_lab.native.train import local_rows


@torch.no_grad()
def native_logits(native: NativeModel, batch: torch.Tensor) -> torch.Tensor:
    """batch [B, T] int64 -> fp32 logits [B, T, vocab], the same on every rank."""
    native.module.eval()
    ids = local_rows(native, batch).to(native.device)
    config = native.module.config
    if native.layout.pp == 1:
        logits = native.module(ids).logits
    else:
        pp = native.mesh["pp"]
        stage, group = pp.get_local_rank(), pp.get_group()
        x = ids
        if stage > 0:
            x = torch.empty(*ids.shape, config.hidden_size, dtype=native.compute_dtype, device=native.device)
            dist.recv(x, group=group, group_src=stage - 1)
        out = native.module(x)
        if stage < native.layout.pp - 1:
            dist.send(out.contiguous(), group=group, group_dst=stage + 1)
            out = torch.empty(*ids.shape, config.vocab_size, dtype=torch.float32, device=native.device)
        dist.broadcast(out, group=group, group_src=native.layout.pp - 1)
        logits = out
    native.reshard()
    data = native.mesh["data"]
    if data.size() == 1:
        return logits
    gathered = [torch.empty_like(logits) for _ in range(data.size())]
    dist.all_gather(gathered, logits.contiguous(), group=data.get_group())
    return torch.cat(gathered)
