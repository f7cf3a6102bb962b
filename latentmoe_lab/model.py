"""LatentMoEForCausalLM: embeddings, hybrid KDA / Gated DSA blocks with dense or LatentMoE FFNs, LM head.

Images (DESIGN 1.5): the vision tower turns pixel_values into one feature per image placeholder token;
the features replace those tokens' embeddings in order, and from there on image and text tokens share
every attention layer and every expert.

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
from latentmoe_lab.layers.packed import sequence_start_from_cu_seqlens
from latentmoe_lab.layers.vision import VisionTower


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

    def forward(self, x: torch.Tensor, layer_cache=None, sequence_start: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]. sequence_start [B, T]: packed sequences (layers/packed.py)."""
        x = x + self.attn(self.attn_norm(x), layer_cache, sequence_start=sequence_start)
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
        self.vision = VisionTower(config) if config.vision is not None else None

    def new_cache(self) -> HybridCache:
        return HybridCache(self.config)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                cache: HybridCache | None = None, image_grids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids: [B, T] int64 -> CausalLMOutput(logits [B, T, vocab] fp32, cache).

        With a cache, the tokens continue the cached sequence and the cache is updated in place.
        pixel_values [N, C*p*p] and image_grids [I, 2] (from `latentmoe_lab.multimodal`) hold the images
        whose placeholder tokens appear in input_ids, in order.
        cu_seqlens [S + 1]: input_ids [1, total] packs S sequences back to back (0, l_0, l_0 + l_1, ..., total);
        no token attends to, or carries KDA state from, another sequence. Not with a cache.
        """
        self._check_input_ids(input_ids, cache)
        sequence_start = None
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: the packed layout (cu_seqlens) needs one row [1, total], "
                                 f"got shape {tuple(input_ids.shape)}")
            if cache is not None:
                raise ValueError("cu_seqlens: packed sequences cannot continue a cache; pass cache=None")
            sequence_start = sequence_start_from_cu_seqlens(cu_seqlens, input_ids.shape[1]).to(input_ids.device)
        x = self._embed(input_ids, pixel_values, image_grids)
        for i, block in enumerate(self.layers):
            x = block(x, None if cache is None else cache[i], sequence_start)
        if cache is not None:
            cache.seq_len += input_ids.shape[1]
        logits = self.lm_head(self.norm(x)).float()
        return CausalLMOutput(logits=logits, cache=cache)

    def _embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
               image_grids: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings [B, T, hidden], image placeholders replaced by the vision tower's features.

        Without pixel_values the call is text only and every id, the image ids included, keeps its
        embedding (decode steps after an image, and tests that draw random ids, rely on that).
        """
        x = self.embed_tokens(input_ids)
        if pixel_values is None:
            if image_grids is not None:
                raise ValueError("image_grids: given without pixel_values")
            return x
        if self.vision is None:
            raise ValueError("pixel_values: this model has no vision tower (config.vision is None)")
        if image_grids is None:
            raise ValueError("image_grids: required with pixel_values, one (rows, cols) of patches per image [I, 2]")
        placeholders = input_ids == self.config.vision.image_token_id
        self.vision.check_inputs(pixel_values, image_grids)
        _check_placeholder_spans(placeholders, self.vision.tokens_per_image(image_grids), image_grids)
        features = self.vision(pixel_values, image_grids)  # [M, hidden], one per placeholder, in order
        # masked_scatter fills the masked positions in row-major (b, t) order: the i-th placeholder gets feature i
        return x.masked_scatter(placeholders[..., None], features.to(x.dtype))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | None = None, generator: torch.Generator | None = None,
                 pixel_values: torch.Tensor | None = None, image_grids: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill the prompt once, then decode token by token over the hybrid cache.

        input_ids: [B, T] -> [B, T + n] with n <= max_new_tokens (fewer when every row hit eos_token_id).
        Greedy by default; do_sample=True samples with temperature / top-k / top-p.
        pixel_values / image_grids: the prompt's images (see forward); they are used in the prefill only.
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
        logits = self(input_ids, pixel_values, cache, image_grids).logits[:, -1]
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


def _check_placeholder_spans(placeholders: torch.Tensor, per_image: torch.Tensor, image_grids: torch.Tensor) -> None:
    """Placeholders [B, T] bool must match the features: in total, and run by run when each image is one run."""
    expected = int(per_image.sum())
    found = int(placeholders.sum())
    if found != expected:
        raise ValueError(f"input_ids: holds {found} image placeholder tokens but pixel_values give {expected} "
                         f"image features ({per_image.tolist()} per image from image_grids)")
    run_starts = placeholders & ~torch.nn.functional.pad(placeholders[:, :-1], (1, 0), value=False)
    if int(run_starts.sum()) != per_image.numel():
        return  # adjacent images without start / end tokens merge into one run; the total already matched
    run_of = (run_starts.flatten().cumsum(0) - 1)[placeholders.flatten()]
    run_lengths = torch.bincount(run_of, minlength=per_image.numel()).to(per_image.device)
    mismatch = (run_lengths != per_image).nonzero()
    if mismatch.numel():
        i = int(mismatch[0])
        raise ValueError(f"input_ids: image {i} has {int(run_lengths[i])} placeholder tokens but its grid "
                         f"{image_grids[i].tolist()} gives {int(per_image[i])} features")


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
