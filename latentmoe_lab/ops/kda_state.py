"""The inter-chunk half of chunked KDA (ops/kda.py): the state hand-off from chunk to chunk, forward and backward.

Per chunk n, with S_n the state at its start (all batched over B*H):

    V'_n    = U_n - W_n S_n                        # [C, V]: the chunk's delta-rule writes
    S_{n+1} = d_n * S_n + Kend_n V'_n              # d_n = exp(Gamma_C) per key channel, Kend_n [K, C]

`chunk_states` runs that loop once forward and once in reverse for the backward (`ChunkStates`), writing
into preallocated outputs. `chunk_states_plain` is its twin, the same loop under autograd
(tests/test_kda_fast.py compares them). Why a hand-written backward: autograd through the loop makes, for
every w[n], u[n], Kend[n], d[n] it indexed, a SelectBackward that allocates and zero-fills a full-size
gradient, plus a stack of the per-chunk outputs, ~1,300 copies and ~90 fills per training step of the mini
model. The reverse loop keeps only the two products that depend on the next chunk's state gradient; the
gradients of W, Kend and d are batched over all chunks after it.

Backward, with G_n the gradient reaching S_{n+1} (the final state's gradient for the last chunk):

    dV'_n = (gradient of the writes)_n + Kend_n^T G_n
    dS_n  = (gradient of the chunk starts)_n + d_n * G_n - W_n^T dV'_n       (= G_{n-1})
    dU_n = dV'_n,  dW_n = -dV'_n S_n^T,  dKend_n = G_n V'_n^T,  dd_n = sum_v G_n * S_n
"""
from __future__ import annotations

import torch


class ChunkStates(torch.autograd.Function):
    """w [N, BH, C, K], u [N, BH, C, V], k_to_end [N, BH, K, C], whole_chunk [N, BH, K], state [BH, K, V] ->
    (chunk starts S_0..S_{N-1} [N, BH, K, V], writes V' [N, BH, C, V], final state S_N [BH, K, V])."""

    @staticmethod
    def forward(ctx, w, u, k_to_end, whole_chunk, state):
        num_chunks = w.shape[0]
        states = state.new_empty((num_chunks + 1, *state.shape))  # S_0 .. S_N
        writes = torch.empty_like(u)
        states[0] = state
        for n in range(num_chunks):
            torch.baddbmm(u[n], w[n], states[n], alpha=-1.0, out=writes[n])
            torch.mul(states[n], whole_chunk[n, :, :, None], out=states[n + 1])
            states[n + 1].baddbmm_(k_to_end[n], writes[n])
        ctx.save_for_backward(w, k_to_end, whole_chunk, states, writes)
        ctx.set_materialize_grads(False)  # an output nothing read gets None, not a zero-filled gradient
        return states[:num_chunks], writes, states[num_chunks].clone()

    @staticmethod
    def backward(ctx, grad_starts, grad_writes, grad_final):
        w, k_to_end, whole_chunk, states, writes = ctx.saved_tensors
        num_chunks = w.shape[0]
        starts = states[:num_chunks]
        # G_n for every chunk (the gradient reaching S_{n+1}) and dV'_n, filled by the reverse loop.
        grad_next = torch.empty_like(starts)
        grad_v = torch.empty_like(writes) if grad_writes is None else grad_writes.clone()
        if grad_final is None:
            grad_next[-1].zero_()
        else:
            grad_next[-1] = grad_final
        grad_state = torch.empty_like(states[0])
        for n in range(num_chunks - 1, -1, -1):
            carry = grad_next[n]
            if grad_writes is None:
                torch.bmm(k_to_end[n].transpose(-1, -2), carry, out=grad_v[n])
            else:
                grad_v[n].baddbmm_(k_to_end[n].transpose(-1, -2), carry)
            into = grad_next[n - 1] if n > 0 else grad_state  # dS_n is G_{n-1}
            if grad_starts is None:
                torch.mul(carry, whole_chunk[n, :, :, None], out=into)
            else:
                torch.addcmul(grad_starts[n], carry, whole_chunk[n, :, :, None], out=into)
            into.baddbmm_(w[n].transpose(-1, -2), grad_v[n], alpha=-1.0)
        grad_w = torch.matmul(grad_v, starts.transpose(-1, -2)).neg_()
        grad_k_to_end = torch.matmul(grad_next, writes.transpose(-1, -2))
        grad_whole_chunk = (grad_next * starts).sum(dim=-1)
        return grad_w, grad_v, grad_k_to_end, grad_whole_chunk, grad_state


def chunk_states(w: torch.Tensor, u: torch.Tensor, k_to_end: torch.Tensor, whole_chunk: torch.Tensor,
                 state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state hand-off of every chunk, shapes as in `ChunkStates`, with its reverse-loop backward."""
    return ChunkStates.apply(w, u, k_to_end, whole_chunk, state)


def chunk_states_plain(w: torch.Tensor, u: torch.Tensor, k_to_end: torch.Tensor, whole_chunk: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_states` as a plain loop under autograd (the reference twin)."""
    starts, writes = [], []
    for n in range(w.shape[0]):
        starts.append(state)
        writes.append(torch.baddbmm(u[n], w[n], state, alpha=-1.0))
        state = torch.baddbmm(whole_chunk[n, :, :, None] * state, k_to_end[n], writes[-1])
    return torch.stack(starts), torch.stack(writes), state
