"""LatentMoEForCausalLM: embeddings, hybrid KDA / Gated DSA blocks with dense or LatentMoE FFNs, LM head.

Block i (pre-norm residual):
    h = x + Attn_i(RMSNorm(x))          Attn_i = KDA or Gated DSA, from config.layer_types[i]
    y = h + FFN_i(RMSNorm(h))           FFN_i  = dense SwiGLU for i < first_dense_layers, else LatentMoE
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from latentmoe_lab.cache import HybridCache
from latentmoe_lab.config import KDA, ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.layers.norm import RMSNorm


@dataclass
class CausalLMOutput:
    """logits: [B, T, vocab]; cache: the updated HybridCache when one was passed."""

    logits: torch.Tensor
    cache: HybridCache | None = None


class DecoderBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        self.is_moe = config.is_moe_layer(layer_idx)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = KimiDeltaAttention(config) if self.attention_type == KDA else GatedDSA(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = (LatentMoE(config) if self.is_moe
                    else SwiGLU(config.hidden_size, config.dense_intermediate_size))

    def forward(self, x: torch.Tensor, layer_cache=None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        x = x + self.attn(self.attn_norm(x), layer_cache)
        return x + self.ffn(self.ffn_norm(x))


class LatentMoEForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=config.initializer_range)

    def new_cache(self) -> HybridCache:
        return HybridCache(self.config)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                cache: HybridCache | None = None) -> CausalLMOutput:
        """input_ids: [B, T] int64 -> CausalLMOutput(logits [B, T, vocab] fp32, cache).

        With a cache, the tokens continue the cached sequence and the cache is updated in place.
        """
        self._check_input_ids(input_ids, cache)
        if pixel_values is not None:
            raise ValueError("pixel_values: this build has no vision tower yet; pass None (text only)")
        x = self.embed_tokens(input_ids)
        for i, block in enumerate(self.layers):
            x = block(x, None if cache is None else cache[i])
        if cache is not None:
            cache.seq_len += input_ids.shape[1]
        logits = self.lm_head(self.norm(x)).float()
        return CausalLMOutput(logits=logits, cache=cache)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Prefill the prompt once, then decode token by token over the hybrid cache.

        input_ids: [B, T] -> [B, T + n] with n <= max_new_tokens (fewer when every row hit eos_token_id).
        Greedy by default; do_sample=True samples with temperature / top-k / top-p.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature: must be > 0 when sampling, got {temperature!r}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {top_k!r}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p!r}")
        self._check_input_ids(input_ids, None)
        total = input_ids.shape[1] + max_new_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(f"max_new_tokens: prompt + new tokens ({total}) exceed "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        tokens = input_ids
        if max_new_tokens == 0:
            return tokens
        cache = self.new_cache()
        logits = self(input_ids, cache=cache).logits[:, -1]
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = _pick_next(logits, do_sample, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self(next_token[:, None], cache=cache).logits[:, -1]
        return tokens

    def _check_input_ids(self, input_ids: torch.Tensor, cache: HybridCache | None) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError("input_ids: expected an int64 tensor [B, T]")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids: token ids must lie in [0, {self.config.vocab_size})")
        past = 0 if cache is None else cache.seq_len
        if past + input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"input_ids: sequence length {past + input_ids.shape[1]} exceeds "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        if cache is not None and len(cache) != self.config.num_layers:
            raise ValueError(f"cache: has {len(cache)} layer entries, the model has {self.config.num_layers}")


def _pick_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None,
               top_p: float | None, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, vocab] -> next token ids [B]."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
