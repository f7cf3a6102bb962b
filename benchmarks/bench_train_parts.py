"""The pieces bench_train.py measures with: the matmul rate, model FLOPs per token, the dense reference
transformer, held-out bits per byte, and per-component step times (module hooks)."""
from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.layers.moe import LatentMoE


def matmul_gflops(size: int = 1024, repeats: int = 3) -> float:
    """fp32 [size, size] @ [size, size] GFLOP/s, the median of `repeats` after a warm-up."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times) / 1e9


def _mean_keys(seq_len: int, limit: int | None = None) -> float:
    """Keys a causal query attends to, averaged over positions 0..seq_len-1 (at most `limit` each)."""
    return sum(min(t + 1, limit or seq_len) for t in range(seq_len)) / seq_len


def model_flops_per_token(model: nn.Module, seq_len: int) -> dict:
    """Training FLOPs per token (forward + backward = 3 x forward, 2 FLOPs per multiply-add):

        6 x active parameters     every weight matrix except the embedding lookup (and the vision tower, idle on
                                  text); routed experts count top_k / E of their weights
        + 6 x attention MACs      per token and layer, what the weights do not cover:
            softmax attention     heads x (d_qk + d_v) x mean attended keys (DSA: at most indexer.topk keys),
                                  + the DSA indexer's heads x head_dim x mean causal keys (it scores every key)
            KDA                   heads x (2 d_k d_v + (C / 2) (d_k + d_v)): reading and updating the d_k x d_v
                                  state, and the intra-chunk scores and values over half a chunk C on average
            dense reference       d_model x 2 x mean causal keys (its learned positions, a lookup, not counted)
    """
    if isinstance(model, DenseCausalLM):
        active = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embed.", "pos")))
        attention = model.num_layers * model.d_model * 2 * _mean_keys(seq_len)
        return {"active_parameters": active, "attention_macs": attention, "flops_per_token": 6 * (active + attention)}
    config: ModelConfig = model.config
    active = 0.0
    for name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if not own or name.startswith(("embed_tokens", "vision")):
            continue
        scale = 1.0
        if name.endswith("experts") and isinstance(model.get_submodule(name.rsplit(".", 1)[0]), LatentMoE):
            scale = config.moe.top_k / config.moe.num_experts
        active += scale * own
    attention = 0.0
    for kind in config.layer_types:
        if kind == KDA:
            kda = config.kda
            attention += kda.num_heads * (2 * kda.head_dim_k * kda.head_dim_v
                                          + kda.chunk_size / 2 * (kda.head_dim_k + kda.head_dim_v))
        elif kind == DSA:
            mla, indexer = config.mla, config.indexer
            attention += mla.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim) * _mean_keys(
                seq_len, indexer.topk) + indexer.num_heads * indexer.head_dim * _mean_keys(seq_len)
    return {"active_parameters": active, "attention_macs": attention, "flops_per_token": 6 * (active + attention)}


class DenseCausalLM(nn.Module):
    """Byte LM from torch's own modules: embedding, nn.TransformerEncoderLayer x L (pre-norm, GELU, causal mask),
    LayerNorm, linear head. ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, vocab: int, d_model: int, num_layers: int, num_heads: int, ff: int, seq_len: int):
        super().__init__()
        self.d_model, self.num_layers = d_model, num_layers
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, num_heads, ff, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        x = self.encoder(self.embed(ids) + self.pos[:length], mask=mask, is_causal=True)
        return self.head(self.norm(x))

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def dense_like(config: ModelConfig, seq_len: int) -> DenseCausalLM:
    """The dense reference for a preset: 4 layers of width 256 (4 heads, ff 1024), ~3.3M non-embedding parameters
    (mini: ~2.9M active, see model_flops_per_token), the preset's vocabulary."""
    return DenseCausalLM(config.vocab_size, 256, 4, 4, 1024, seq_len)


@torch.no_grad()
def heldout_bits_per_byte(loss_of, rows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-byte cross-entropy over rows [N, T] in bits; loss_of(ids [b, T]) -> mean loss in nats."""
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        ids = rows[start:start + batch]
        targets = ids[:, 1:].numel()
        total += float(loss_of(ids)) * targets
        count += targets
    return total / count / math.log(2)


def components(model) -> list[tuple[str, nn.Module]]:
    named = [("embedding", model.embed_tokens), ("lm_head", model.lm_head)]
    for block in model.layers:
        named.append((f"{block.attention_type}_attention", block.attn))
        named.append(("moe_ffn" if isinstance(block.ffn, LatentMoE) else "dense_ffn", block.ffn))
    return named


class ComponentTimer:
    """Seconds per (phase, component) since the last reset: a forward pre-hook / forward hook pair times each
    component's forward, a full backward pre-hook / backward hook pair its backward."""

    def __init__(self, model):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._started: dict[int, float] = {}
        self.handles = []
        for name, module in components(model):
            self.handles += [
                module.register_forward_pre_hook(self._start),
                module.register_forward_hook(lambda m, i, o, name=name: self._stop(m, "forward", name)),
            ]
            if not isinstance(module, nn.Embedding):  # integer inputs: no backward to time
                self.handles += [
                    module.register_full_backward_pre_hook(lambda m, g: self._start(m, None)),
                    module.register_full_backward_hook(lambda m, gi, go, name=name: self._stop(m, "backward", name)),
                ]

    def _start(self, module, _inputs):
        self._started[id(module)] = time.perf_counter()

    def _stop(self, module, phase: str, name: str):
        self.seconds[(phase, name)] += time.perf_counter() - self._started.pop(id(module))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
