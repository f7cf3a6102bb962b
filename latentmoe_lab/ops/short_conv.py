"""The KDA layer's short causal depthwise conv as shifted multiply-adds in the token-major layout [B, T, C].

    out[b, t, c] = sum_j weight[c, j] * x[b, t - (kernel - 1 - j), c]       j = 0 .. kernel-1

where the kernel-1 positions before t = 0 are read from `tail` ([B, kernel-1, C]: the previous tokens, from a
cache) or are zeros (tail None). Why not F.conv1d: at the training shape of the mini model ([8, 128, 576],
kernel 4, 1 thread) mkldnn's depthwise conv wants the channels-first layout, so the step paid a padded copy,
two transposing copies, a conv backward of ~8 ms (~4x its forward) and a SiLU on a strided tensor (~5 ms of
backward) behind it. Here forward and backward are a few elementwise passes over contiguous rows (each tap is
x shifted by its lag), no padded copy of x is made, and the output stays token-major. Products are summed in
fp32, as a conv kernel accumulates (and as layers/kda_paged.py's decode conv does). The plain twin is F.conv1d
(`causal_depthwise_conv_plain`; tests/test_kda_fast.py compares them, outputs and gradients).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from latentmoe_lab.ops.precision import at_least_fp32


class CausalDepthwiseConv(torch.autograd.Function):
    """x [B, T, C], tail [B, kernel-1, C] or None (zeros), weight [C, kernel] -> out [B, T, C] in x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tail: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        taps = at_least_fp32(weight).t().contiguous()  # [kernel, C]: one contiguous row per tap
        rows = at_least_fp32(x)
        out = rows * taps[-1]  # lag 0
        for j, lag, reach in _shifts(taps.shape[0], x.shape[1]):
            out[:, lag:].addcmul_(rows[:, :max(rows.shape[1] - lag, 0)], taps[j])
            if tail is not None:  # the first `reach` outputs read the tail's last rows
                out[:, :reach].addcmul_(_tail_rows(tail, lag, reach), taps[j])
        ctx.save_for_backward(x, tail, taps)
        ctx.weight_dtype = weight.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, tail, taps = ctx.saved_tensors
        kernel, seq_len = taps.shape[0], x.shape[1]
        grad = at_least_fp32(grad)
        grad_x = grad_tail = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad * taps[-1]
            for j, lag, _ in _shifts(kernel, seq_len):
                grad_x[:, :max(seq_len - lag, 0)].addcmul_(grad[:, lag:], taps[j])
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_tail = torch.zeros(tail.shape, dtype=grad.dtype, device=grad.device)
            for j, lag, reach in _shifts(kernel, seq_len):
                grad_tail[:, tail.shape[1] - lag:][:, :reach].addcmul_(grad[:, :reach], taps[j])
            grad_tail = grad_tail.to(tail.dtype)
        if ctx.needs_input_grad[2]:
            rows = at_least_fp32(x)
            grad_weight = torch.empty_like(taps)
            grad_weight[-1] = (grad * rows).sum(dim=(0, 1))
            for j, lag, reach in _shifts(kernel, seq_len):
                grad_weight[j] = (grad[:, lag:] * rows[:, :max(seq_len - lag, 0)]).sum(dim=(0, 1))
                if tail is not None:
                    grad_weight[j] += (grad[:, :reach] * _tail_rows(tail, lag, reach)).sum(dim=(0, 1))
            grad_weight = grad_weight.t().to(ctx.weight_dtype)
        return grad_x, grad_tail, grad_weight


def _shifts(kernel: int, seq_len: int):
    """(tap j, its lag kernel-1-j, reach = min(lag, T): the leading outputs that read the tail), taps with lag > 0."""
    return [(j, kernel - 1 - j, min(kernel - 1 - j, seq_len)) for j in range(kernel - 1)]


def _tail_rows(tail: torch.Tensor, lag: int, reach: int) -> torch.Tensor:
    """The tail rows a tap of this lag reads for the first `reach` outputs: [B, reach, C], at least fp32."""
    return at_least_fp32(tail[:, tail.shape[1] - lag:][:, :reach])


def causal_depthwise_conv(x: torch.Tensor, tail: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, C], tail [B, kernel-1, C] (the tokens before x; None: zeros), weight [C, kernel] -> [B, T, C]."""
    if torch.compiler.is_compiling():  # the same sum in plain ops: the backward's out= slices cannot be traced
        kernel, seq_len = weight.shape[1], x.shape[1]
        padded = at_least_fp32(torch.cat([tail.to(x.dtype), x], 1) if tail is not None
                               else F.pad(x, (0, 0, kernel - 1, 0)))
        taps = at_least_fp32(weight)
        out = padded[:, kernel - 1:] * taps[:, -1]
        for j in range(kernel - 1):
            out = out + padded[:, j:j + seq_len] * taps[:, j]
        return out.to(x.dtype)
    return CausalDepthwiseConv.apply(x, tail, weight)


def causal_depthwise_conv_plain(x: torch.Tensor, tail: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """`causal_depthwise_conv` through F.conv1d on [tail | x] in the channels-first layout (the reference twin)."""
    padded = torch.cat([tail.to(x.dtype), x], dim=1) if tail is not None else F.pad(x, (0, 0, weight.shape[1] - 1, 0))
    out = F.conv1d(rearrange(padded, "b t c -> b c t"), weight[:, None, :], groups=weight.shape[0])
    return rearrange(out, "b c t -> b t c")
