"""The KDA layer's short causal depthwise conv as shifted multiply-adds in the token-major layout [B, T, C].

    out[b, t, c] = sum_j weight[c, j] * padded[b, t + j, c]        j = 0 .. kernel-1

padded is the input with its kernel-1 history rows in front ([B, T + kernel - 1, C]). Why not F.conv1d: at the
training shape of the mini model ([8, 128, 576], kernel 4, 1 thread) mkldnn's depthwise conv wants the
channels-first layout, so the step paid two transposing copies, a conv backward of ~8 ms (~4x its forward) and
a SiLU on a strided tensor (~5 ms backward) behind it. Here forward and backward are kernel passes each of
plain elementwise work over contiguous rows, and the output stays token-major. Products are summed in fp32, as
a conv kernel accumulates (and as layers/kda_paged.py's decode conv does). The plain twin is F.conv1d
(`causal_depthwise_conv_plain`; tests/test_kda_fast.py compares them, outputs and gradients).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from latentmoe_lab.ops.precision import at_least_fp32


class CausalDepthwiseConv(torch.autograd.Function):
    """padded [B, T + kernel - 1, C], weight [C, kernel] -> out [B, T, C] in padded's dtype."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        kernel = weight.shape[1]
        seq_len = padded.shape[1] - kernel + 1
        taps = at_least_fp32(weight).t().contiguous()  # [kernel, C]: one contiguous row per tap
        rows = at_least_fp32(padded)
        out = rows[:, :seq_len] * taps[0]
        for j in range(1, kernel):
            out.addcmul_(rows[:, j:j + seq_len], taps[j])
        ctx.save_for_backward(padded, taps)
        ctx.weight_dtype = weight.dtype
        return out.to(padded.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded, taps = ctx.saved_tensors
        kernel, seq_len = taps.shape[0], grad.shape[1]
        grad = at_least_fp32(grad)
        grad_padded = grad_weight = None
        if ctx.needs_input_grad[0]:
            # tap 0 covers rows [0, T): written, not accumulated, so only the last kernel-1 rows need zeros
            grad_padded = torch.empty(padded.shape, dtype=grad.dtype, device=grad.device)
            torch.mul(grad, taps[0], out=grad_padded[:, :seq_len])
            grad_padded[:, seq_len:].zero_()
            for j in range(1, kernel):
                grad_padded[:, j:j + seq_len].addcmul_(grad, taps[j])
            grad_padded = grad_padded.to(padded.dtype)
        if ctx.needs_input_grad[1]:
            rows = at_least_fp32(padded)
            grad_weight = grad.new_empty(taps.shape)  # [kernel, C]
            products = torch.empty_like(grad)  # one buffer for every tap: a fresh [B, T, C] per tap costs 3x the mul
            for j in range(kernel):
                torch.mul(grad, rows[:, j:j + seq_len], out=products)
                torch.sum(products, dim=(0, 1), out=grad_weight[j])
            grad_weight = grad_weight.t().to(ctx.weight_dtype)
        return grad_padded, grad_weight


def causal_depthwise_conv(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """padded [B, T + kernel - 1, C] (history rows first), weight [C, kernel] -> [B, T, C]."""
    if torch.compiler.is_compiling():  # the same sum as plain ops: the backward's out= slices cannot be traced
        seq_len, taps = padded.shape[1] - weight.shape[1] + 1, at_least_fp32(weight)
        rows = at_least_fp32(padded)
        return sum(rows[:, j:j + seq_len] * taps[:, j] for j in range(weight.shape[1])).to(padded.dtype)
    return CausalDepthwiseConv.apply(padded, weight)


def causal_depthwise_conv_plain(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`causal_depthwise_conv` through F.conv1d in the channels-first layout (the reference twin)."""
    out = F.conv1d(rearrange(padded, "b t c -> b c t"), weight[:, None, :], groups=weight.shape[0])
    return rearrange(out, "b c t -> b t c")
