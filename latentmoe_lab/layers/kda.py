"""Kimi Delta Attention layer (docs/design.md §1.3): projections, short conv, gates and the KDA op.

    q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x)))
    v    = SiLU(ShortConv(W_v x))
    beta = sigmoid(W_b x)                                    one per head
    g    = forget gate, one log decay per key channel        ("lower_bound" or "softplus")
    out  = W_o [ RMSNorm_head(KDA(q, k, v, g, beta)) * sigmoid(W_g x) ]

The three short convs are one depthwise causal conv over the concatenated q|k|v
channels, so a decode step carries a single conv tail [B, channels, kernel-1].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn
from torch.profiler import record_function

from latentmoe_lab.cache import KDALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.kda_paged import advance_gathered, advance_in_pool, short_conv_paged
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import check_sequence_start
from latentmoe_lab.ops.activations import sigmoid, silu, softplus
from latentmoe_lab.ops.backend import resolve_backend
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.kda_decode import kda_decode_step_
from latentmoe_lab.ops.norms import l2_norm
from latentmoe_lab.ops.precision import at_least_fp32
from latentmoe_lab.ops.short_conv import causal_depthwise_conv, causal_depthwise_conv_plain
from latentmoe_lab.paged_pools import KDAPool

# Initial per-step decay rate dt = softplus(dt_bias), log-uniform in this range (as in Mamba):
# small dt means slow forgetting at the start of training, in both gate forms.
DT_INIT_RANGE = (1e-3, 1e-1)
# exp(A_log) starts uniform in this range: per-head spread of decay speeds.
A_INIT_RANGE = (1.0, 16.0)
# Log decay at the first token of a packed sequence: exp(-1000) is exactly 0 in fp32 and fp64, so the
# previous sequence's state is erased (the KDA ops stay finite for g = -1000; -inf would give inf - inf).
SEQUENCE_START_DECAY = -1000.0


class KimiDeltaAttention(nn.Module):
    """KDA token mixer. forward(x [B, T, hidden], cache) -> [B, T, hidden].

    paged_decode (attribute): how the paged path runs its decodes, "fused" (default, in place) or
    "recurrent" (the reference op on a gathered copy); see `_decode_step_`. short_conv_form (attribute): the
    contiguous path's short conv, "shifted" (default) or its F.conv1d twin "conv1d"; see `_short_conv`.
    """

    PAGED_DECODES = ("fused", "recurrent")
    SHORT_CONV_FORMS = ("shifted", "conv1d")

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.paged_decode = "fused"
        self.short_conv_form = "shifted"
        kda = config.kda
        hidden = config.hidden_size
        self.num_heads = kda.num_heads
        self.head_dim_k = kda.head_dim_k
        self.head_dim_v = kda.head_dim_v
        self.conv_kernel = kda.conv_kernel
        self.chunk_size = kda.chunk_size
        self.gate_form = kda.gate_form
        self.gate_lower_bound = kda.gate_lower_bound
        key_width = kda.num_heads * kda.head_dim_k
        value_width = kda.num_heads * kda.head_dim_v
        self.conv_channels = 2 * key_width + value_width

        self.q_proj = nn.Linear(hidden, key_width, bias=False)
        self.k_proj = nn.Linear(hidden, key_width, bias=False)
        self.v_proj = nn.Linear(hidden, value_width, bias=False)
        self.conv = nn.Conv1d(self.conv_channels, self.conv_channels, kda.conv_kernel,
                              groups=self.conv_channels, bias=False)
        self.b_proj = nn.Linear(hidden, kda.num_heads, bias=False)

        self.f_down = nn.Linear(hidden, kda.gate_rank, bias=False)
        self.f_up = nn.Linear(kda.gate_rank, key_width, bias=False)
        self.A_log = nn.Parameter(torch.empty(kda.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(key_width))

        if kda.output_gate_rank is None:
            self.g_proj = nn.Linear(hidden, value_width, bias=False)
        else:
            self.g_proj = nn.Sequential(nn.Linear(hidden, kda.output_gate_rank, bias=False),
                                        nn.Linear(kda.output_gate_rank, value_width, bias=False))
        self.o_norm = RMSNorm(kda.head_dim_v, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(value_width, hidden, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """A_log = log U[1, 16]; dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1]."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE).log())
        low, high = (math.log(x) for x in DT_INIT_RANGE)
        dt = torch.empty_like(self.dt_bias).uniform_(low, high).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log-space decay g [B, T, H, d_k] in at least fp32: in [lower_bound, 0] or, for "softplus", <= 0."""
        logits = rearrange(at_least_fp32(self.f_up(self.f_down(x))) + at_least_fp32(self.dt_bias),
                           "b t (h d) -> b t h d", h=self.num_heads)
        rate = at_least_fp32(self.A_log).exp()[:, None]  # [H, 1]
        if self.gate_form == "lower_bound":
            return self.gate_lower_bound * sigmoid(rate * logits)
        return -rate * softplus(logits)

    @record_function("attn.kda")
    def forward(self, x: torch.Tensor, cache: KDALayerCache | None = None,
                sequence_start: torch.Tensor | None = None, batch: ForwardBatch | None = None,
                pool: KDAPool | None = None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]. A cache is read, then updated in place.

        sequence_start [B, T] int64 (packed sequences, no cache; see layers/packed.py): the state is erased
        at each sequence's first token, and the short conv does not reach back into the previous sequence.
        batch + pool (serving, docs/design.md §6.4): x is [1, total, hidden], the new tokens of batch's S
        sequences; each continues from the state and conv tail in its slot of `pool`, written back after.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.q_proj.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape [B, T, {self.q_proj.in_features}], got {shape}")
        if batch is not None or pool is not None:
            return self._forward_paged(x, batch, pool, cache, sequence_start)
        if cache is not None and not isinstance(cache, KDALayerCache):
            raise TypeError(f"cache: expected KDALayerCache or None, got {type(cache).__name__}")
        check_sequence_start(sequence_start, x, cache)
        seq_len = x.shape[1]

        qkv = self._qkv(x)
        qkv = (self._short_conv(qkv, cache) if sequence_start is None
               else self._short_conv_packed(qkv, sequence_start))
        q, k, v, g, beta = self._heads(qkv, x)
        if sequence_start is not None:
            first = sequence_start == torch.arange(seq_len, device=x.device)  # [B, T]
            g = g.masked_fill(first[..., None, None], SEQUENCE_START_DECAY)

        initial_state = None if cache is None else cache.recurrent_state
        keep_state = cache is not None
        if seq_len == 1:
            out, state = kda_recurrent(q, k, v, g, beta, initial_state=initial_state,
                                       output_final_state=keep_state)
        else:
            out, state = kda_chunked(q, k, v, g, beta, initial_state=initial_state,
                                     output_final_state=keep_state, chunk_size=self.chunk_size)
        if keep_state:
            cache.recurrent_state = state
        return self._output(out, x)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> the concatenated q|k|v projections [B, T, channels], before the short conv."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def _heads(self, conv_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Short-conv output [B, T, channels] and x -> q, k ([B, T, H, d_k], L2-normed), v, g (fp32), beta (fp32)."""
        qkv = silu(conv_out)
        key_width = self.num_heads * self.head_dim_k
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.num_heads)
                   for t in qkv.split([key_width, key_width, qkv.shape[-1] - 2 * key_width], dim=-1))
        q, k = l2_norm(q, eps=1e-6), l2_norm(k, eps=1e-6)
        return q, k, v, self.forget_gate(x), sigmoid(at_least_fp32(self.b_proj(x)))

    def _output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """KDA output [B, T, H, d_v] -> W_o [RMSNorm_head(out) * sigmoid(W_g x)] [B, T, hidden]."""
        gate = rearrange(sigmoid(self.g_proj(x)), "b t (h d) -> b t h d", h=self.num_heads)
        out = self.o_norm(out) * gate
        return self.o_proj(rearrange(out, "b t h d -> b t (h d)"))

    def _short_conv(self, qkv: torch.Tensor, cache: KDALayerCache | None) -> torch.Tensor:
        """Depthwise causal conv over [B, T, channels]; the kernel-1 tail comes from / goes to the cache.

        short_conv_form (attribute): "shifted" (default, ops/short_conv.py) or "conv1d" (its F.conv1d twin).
        """
        if self.short_conv_form not in self.SHORT_CONV_FORMS:
            raise ValueError(f"short_conv_form: expected one of {self.SHORT_CONV_FORMS}, got {self.short_conv_form!r}")
        batch = qkv.shape[0]
        history = self.conv_kernel - 1
        tail = None if cache is None else cache.conv_state
        if tail is not None:
            if tail.shape != (batch, self.conv_channels, history):
                raise ValueError(f"cache.conv_state: expected shape [B, channels, kernel-1] = "
                                 f"{(batch, self.conv_channels, history)}, got {tuple(tail.shape)}")
            tail = rearrange(tail, "b c j -> b j c").to(qkv.dtype)
        if cache is not None:
            before = tail if tail is not None else qkv.new_zeros(batch, history, self.conv_channels)
            recent = torch.cat([before, qkv[:, -history:]], dim=1)[:, -history:]  # a copy, not a view of qkv
            cache.conv_state = rearrange(recent, "b j c -> b c j").contiguous()
        conv = causal_depthwise_conv if self.short_conv_form == "shifted" else causal_depthwise_conv_plain
        return conv(qkv, tail, self.conv.weight[:, 0, :])

    def _short_conv_packed(self, qkv: torch.Tensor, sequence_start: torch.Tensor) -> torch.Tensor:
        """The causal conv of `_short_conv` over [B, T, channels], with taps before a token's sequence_start zeroed."""
        history = self.conv_kernel - 1
        padded = F.pad(rearrange(qkv, "b t c -> b c t"), (history, 0))
        windows = padded.unfold(-1, self.conv_kernel, 1)  # [B, C, T, kernel]; slot j holds input t - (history - j)
        lag = torch.arange(history, -1, -1, device=qkv.device)  # [kernel]
        position = torch.arange(qkv.shape[1], device=qkv.device) - sequence_start  # [B, T], within own sequence
        inside = lag <= position[:, None, :, None]  # [B, 1, T, kernel]
        return einsum(windows * inside, self.conv.weight[:, 0, :], "b c t j, c j -> b t c")

    # ------------------------------------------------------------------------------ paged (serving)
    def _forward_paged(self, x: torch.Tensor, batch: ForwardBatch | None, pool: KDAPool | None,
                       cache, sequence_start) -> torch.Tensor:
        """The varlen forward over batch's S sequences: x [1, total, hidden] -> [1, total, hidden].

        The conv tails and states live in the pool's slots (layers/kda_paged.py). paged_decode "fused" on the
        torch backend without gradients advances the states in place in the pool (`advance_in_pool`);
        otherwise, and always for "recurrent", on a gathered copy (`advance_gathered`, with
        `_decode_step_`). On CUDA backend="auto" runs the Triton kernels there, as in the contiguous path.
        Kernels that could take slot ids later: latentmoe_kernels.kda's recurrent and state kernels read and
        write one dense [B, H, d_k, d_v] state; given pool.state and state_slot they would update the rows
        in place and drop the gather / scatter.
        """
        if batch is None or not isinstance(pool, KDAPool):
            raise TypeError(f"batch, pool: the paged path needs a ForwardBatch and a KDAPool, got "
                            f"{type(batch).__name__} and {type(pool).__name__}")
        if cache is not None or sequence_start is not None:
            raise ValueError("batch: the paged path takes no cache and no sequence_start")
        if x.shape[:2] != (1, batch.num_tokens):
            raise ValueError(f"x: expected shape [1, total={batch.num_tokens}, hidden], got {tuple(x.shape)}")
        if self.paged_decode not in self.PAGED_DECODES:
            raise ValueError(f"paged_decode: expected one of {self.PAGED_DECODES}, got {self.paged_decode!r}")
        if batch.state_slot.unique().numel() != batch.num_seqs:
            raise ValueError("batch.state_slot: two sequences share a KDA slot (each needs its own state)")
        heads = self._heads(short_conv_paged(self._qkv(x), batch, pool, self.conv.weight[:, 0, :]), x)
        # in place needs row slices of pool.state to be contiguous views (kda_decode_step_'s [B*H, K, V] view)
        if self.paged_decode == "fused" and pool.state.is_contiguous() \
                and self._fused_decode_applies(pool.state, *heads):
            out = advance_in_pool(pool, batch, heads, self.chunk_size)
        else:
            out = advance_gathered(pool, batch, heads, self.chunk_size, self._decode_step_)
        return self._output(out, x)

    @staticmethod
    def _fused_decode_applies(state: torch.Tensor, *inputs: torch.Tensor) -> bool:
        """ops/kda_decode.py's in-place step can run: torch backend, no gradients, no fp64 tokens on an
        fp32 state (those keep the reference's fp32 math)."""
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        narrowing = state.dtype != torch.float64 and any(t.dtype == torch.float64 for t in inputs)
        return not needs_grad and not narrowing and resolve_backend("auto", *inputs, state) == "torch"

    def _decode_step_(self, state: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
        """One token per sequence on a gathered copy: state [S, H, d_k, d_v] (owned, advanced in place),
        q, k, g [S, H, d_k], v [S, H, d_v], beta [S, H] -> o [S, H, d_v].

        "fused" runs ops/kda_decode.py's in-place step where `_fused_decode_applies`; on CUDA (backend
        "auto" -> Triton, also in place), wherever gradients are needed, for fp64 tokens, and with
        "recurrent" (the reference, kept for comparisons: tests/test_ops_kda_decode.py,
        benchmarks/bench_kda_paged_decode.py) it is `kda_recurrent`.
        """
        inputs = (q, k, v, g, beta)
        if self.paged_decode == "fused" and self._fused_decode_applies(state, *inputs):
            return kda_decode_step_(state, *inputs)
        # with gradients kda_recurrent may save its initial state, which the copy_ below overwrites
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        o, final = kda_recurrent(*(t[:, None] for t in inputs), initial_state=state.clone() if needs_grad else state,
                                 output_final_state=True)
        if final is not state:  # the Triton kernel already advanced state in place
            state.copy_(final)
        return o[:, 0]
