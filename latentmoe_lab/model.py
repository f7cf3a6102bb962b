"""LatentMoEForCausalLM: embeddings, hybrid KDA / Gated DSA blocks with dense or LatentMoE FFNs, LM head.

Images (docs/design.md §1.5): the vision tower turns pixel_values into one feature per image placeholder token;
the features replace those tokens' embeddings in order, and from there on image and text tokens share
every attention layer and every expert.

Block i (pre-norm residual):
    h = x + Attn_i(RMSNorm(x))          Attn_i = KDA or Gated DSA, from config.layer_types[i]
    y = h + FFN_i(RMSNorm(h))           FFN_i  = dense SwiGLU for i < first_dense_layers, else LatentMoE
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from latentmoe_lab.cache import HybridCache
from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.finite import all_finite, check_finite_logits
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.dsa_indexer import link_shared_indexers
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import sequence_start_from_cu_seqlens
from latentmoe_lab.layers.vision import VisionTower
from latentmoe_lab.mtp import MultiTokenPredictor
from latentmoe_lab.paged_pools import PagedPools
from latentmoe_lab.padded import left_pad_rows, prompt_spans, split_images


@dataclass
class CausalLMOutput:
    """logits: [B, T, vocab]; cache: the updated HybridCache when one was passed.

    With labels: loss, the fp32 mean next-token cross-entropy, and aux_loss, the sum over MoE layers of
    their balance and z losses, already scaled by moe.aux_loss_alpha and moe.z_loss_coef (docs/design.md §9).
    """

    logits: torch.Tensor
    cache: HybridCache | None = None
    finite: torch.Tensor | None = None  # [num_layers + 2] bool on the device, see finite.py
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None  # with labels and config.mtp_depth > 0: the MTP head's loss (mtp.py)
    hidden: torch.Tensor | None = None  # serving with batch.hidden_index: [H, hidden] before the final norm


class DecoderBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, attention_type: str | None = None,
                 moe: bool | None = None):
        """attention_type / moe: None = from config for layer_idx (the MTP head's blocks set both, mtp.py)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx] if attention_type is None else attention_type
        self.is_moe = config.is_moe_layer(layer_idx) if moe is None else moe
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = KimiDeltaAttention(config) if self.attention_type == KDA else GatedDSA(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = (LatentMoE(config) if self.is_moe
                    else SwiGLU(config.hidden_size, config.dense_intermediate_size))

    def forward(self, x: torch.Tensor, layer_cache=None, sequence_start: torch.Tensor | None = None,
                batch: ForwardBatch | None = None, pool=None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]. sequence_start [B, T]: packed sequences (layers/packed.py).

        batch + pool (this layer's DSAPool or KDAPool): the paged serving step, x [1, total, hidden].
        """
        x = x + self.attn(self.attn_norm(x), layer_cache, sequence_start=sequence_start, batch=batch, pool=pool)
        return x + self.ffn(self.ffn_norm(x))


class LatentMoEForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config = config
        _refuse_if_too_large(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_layers))
        link_shared_indexers(config, [layer.attn for layer in self.layers])  # dsa.index_share_every
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=config.initializer_range)
        self.vision = VisionTower(config) if config.vision is not None else None
        # mtp_depth 0: no attribute in the state dict, the checkpoint of a model without the head
        self.mtp = (MultiTokenPredictor(config, lambda idx: DecoderBlock(config, idx, attention_type=DSA, moe=False))
                    if config.mtp_depth > 0 else None)

    def new_cache(self) -> HybridCache:
        return HybridCache(self.config)

    def chunk_grid(self) -> int:
        """Where a prompt chunk may end and leave every sum of the forward in the order of a whole prompt: the
        lcm of the KDA layers' chunk size and the DSA layers' query block (batch-invariant serving)."""
        grid = 1
        for block in self.layers:
            grid = math.lcm(grid, block.attn.chunk_size if block.attention_type == KDA else block.attn.query_block)
        return grid

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when config.tie_word_embeddings (again after an empty-weights build,
        which replaces every parameter object)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def save_pretrained(self, path, max_shard_size: int | str = "2GB"):
        """config.json + safetensors weights (sharded above max_shard_size), written atomically; see checkpoint.py."""
        from latentmoe_lab.checkpoint import save_checkpoint

        return save_checkpoint(self, path, max_shard_size)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device_map=None,
                        offload_folder=None, verify_checksums: bool = True) -> "LatentMoEForCausalLM":
        """Load a save_pretrained (or save_quantized) directory through accelerate (empty weights, then load
        and dispatch), every file checked first; verify_checksums=False skips the SHA-256 of each file."""
        from latentmoe_lab.checkpoint import load_checkpoint

        return load_checkpoint(cls, path, dtype=dtype, device_map=device_map, offload_folder=offload_folder,
                               verify_checksums=verify_checksums)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                cache: HybridCache | None = None, image_grids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, batch: ForwardBatch | None = None,
                pools: PagedPools | None = None) -> CausalLMOutput:
        """input_ids: [B, T] int64 -> CausalLMOutput(logits [B, T, vocab] fp32, cache).

        With a cache, the tokens continue the cached sequence and the cache is updated in place.
        pixel_values [N, C*p*p] and image_grids [I, 2] (from `latentmoe_lab.multimodal`) hold the images
        whose placeholder tokens appear in input_ids, in order.
        cu_seqlens [S + 1]: input_ids [1, total] packs S sequences back to back (0, l_0, l_0 + l_1, ..., total);
        no token attends to, or carries KDA state from, another sequence. Not with a cache.
        labels [B, T] int64, aligned with input_ids (shifted here: position t predicts labels[t + 1]); -100 is
        ignored, and so is the first token of each packed sequence. Adds .loss and .aux_loss to the output,
        and .mtp_loss when the model has an MTP head (config.mtp_depth > 0; depth k predicts labels[t + k + 1]).
        attention_mask [B, T]: real tokens. Right padding only (a pad after a row's tokens changes none of
        their logits); left-padded prompts go to generate, which runs each row alone (padded.py).
        A forward that does not finish (any exception, KeyboardInterrupt included) invalidates the cache.
        batch + pools (serving, docs/design.md §6.4; forward_batch.py): input_ids is batch.input_ids [1, total],
        the new tokens of S sequences continuing from the paged pools, which are updated in place. Then
        logits is [R, vocab] fp32 at batch.output_index: one row per sequence at its last new token (only those
        are sampled), then any prompt positions batch.logits_index adds;
        images come as batch.image_features (encode_images), not pixel_values.
        """
        if batch is not None or pools is not None:
            return self._forward_batch(input_ids, batch, pools, pixel_values=pixel_values, cache=cache,
                                       image_grids=image_grids, cu_seqlens=cu_seqlens, labels=labels,
                                       attention_mask=attention_mask)
        _check_labels(labels, input_ids, self.config.vocab_size)
        self._check_input_ids(input_ids, cache)
        _check_right_padded(attention_mask, input_ids, cache)
        sequence_start = None
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: the packed layout (cu_seqlens) needs one row [1, total], "
                                 f"got shape {tuple(input_ids.shape)}")
            if cache is not None:
                raise ValueError("cu_seqlens: packed sequences cannot continue a cache; pass cache=None")
            sequence_start = sequence_start_from_cu_seqlens(cu_seqlens, input_ids.shape[1]).to(input_ids.device)
        x = self._embed(input_ids, pixel_values, image_grids)
        finite = [all_finite(x)]
        try:
            for i, block in enumerate(self.layers):
                x = block(x, None if cache is None else cache[i], sequence_start)
                finite.append(all_finite(x))
        except BaseException as error:  # the layers before i hold the new tokens, the rest do not
            if cache is not None:
                cache.invalidate(f"{type(error).__name__} in layer {i} while appending {input_ids.shape[1]} "
                                 f"tokens at position {cache.seq_len}")
            raise
        if cache is not None:
            cache.seq_len += input_ids.shape[1]
        hidden, x = x, self.norm(x)
        finite.append(all_finite(x))
        logits = self.lm_head(x).float()
        finite = torch.stack(finite)
        if labels is None:
            return CausalLMOutput(logits=logits, cache=cache, finite=finite)
        mtp_loss = None if self.mtp is None else self.mtp.loss(hidden, input_ids, labels, self.embed_tokens,
                                                                 self.lm_head, sequence_start)
        return CausalLMOutput(logits=logits, cache=cache, loss=causal_lm_loss(logits, labels, sequence_start),
                              aux_loss=self.router_losses(), finite=finite, mtp_loss=mtp_loss)

    def router_losses(self) -> torch.Tensor:
        """Scaled aux + z losses of the last forward, summed over the MoE layers (fp32 scalar)."""
        total = self.embed_tokens.weight.new_zeros((), dtype=torch.float32)
        for block in self.layers:
            if block.is_moe:
                total = total + block.ffn.last_aux_loss + block.ffn.last_z_loss
        return total

    def encode_images(self, pixel_values: torch.Tensor, image_grids: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*p*p], image_grids [I, 2] -> vision features [M, hidden], one per placeholder, in order.

        What forward puts in place of the image placeholder tokens; the serving engine computes it once
        per request and hands each step the rows of the placeholders it holds (batch.image_features).
        """
        if self.vision is None:
            raise ValueError("pixel_values: this model has no vision tower (config.vision is None)")
        if image_grids is None:
            raise ValueError("image_grids: required with pixel_values, one (rows, cols) of patches per image [I, 2]")
        return self.vision(pixel_values, image_grids)

    def _forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch | None, pools: PagedPools | None,
                       **not_with_batch) -> CausalLMOutput:
        """One serving step over the paged pools -> CausalLMOutput(logits [R, vocab] fp32, finite flags).

        A step that raises part way leaves the KDA slots of its sequences advanced in the layers before
        the failure: the caller must not continue those sequences from their slots (recompute instead).
        """
        if not isinstance(batch, ForwardBatch) or not isinstance(pools, PagedPools):
            raise TypeError(f"batch, pools: expected a ForwardBatch and PagedPools together, got "
                            f"{type(batch).__name__} and {type(pools).__name__}")
        for name, value in not_with_batch.items():
            if value is not None:
                raise ValueError(f"{name}: not with batch= (images come as batch.image_features, "
                                 "the cache is the pools)")
        self._check_input_ids(input_ids, None)
        if input_ids.shape != batch.input_ids.shape or not torch.equal(input_ids, batch.input_ids):
            raise ValueError("input_ids: must be batch.input_ids [1, total]")
        pools.check_compatible(self.config)
        device = self.embed_tokens.weight.device
        for name, where in (("pools", pools.device), ("batch", batch.input_ids.device)):
            if where.type != device.type:
                raise ValueError(f"{name}: on {where}, the model is on {device}")
        if pools.block_size != batch.block_size:
            raise ValueError(f"batch.block_size: {batch.block_size} differs from the pools' {pools.block_size}")
        batch.check(pools.num_blocks, pools.num_slots, self.config.max_position_embeddings)
        x = self.embed_tokens(input_ids)
        if batch.image_features is not None or batch.image_mask is not None:
            image_token_id = None if self.vision is None else self.config.vision.image_token_id
            mask = batch.checked_image_mask(image_token_id, self.config.hidden_size)
            x = x.masked_scatter(mask[None, :, None], batch.image_features.to(x.dtype))
        finite = [all_finite(x)]
        for i, block in enumerate(self.layers):
            x = block(x, batch=batch, pool=pools.layer(i))
            finite.append(all_finite(x))
        last = self.norm(x[:, batch.output_index])  # [1, R, hidden]: norm and head are token-wise
        finite.append(all_finite(last))
        hidden = None if batch.hidden_index is None else x[0, batch.hidden_index]  # the MTP drafter's input
        return CausalLMOutput(logits=self.lm_head(last).float()[0], finite=torch.stack(finite), hidden=hidden)

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
        features = self.encode_images(pixel_values, image_grids)  # [M, hidden], one per placeholder, in order
        # masked_scatter fills the masked positions in row-major (b, t) order: the i-th placeholder gets feature i
        return x.masked_scatter(placeholders[..., None], features.to(x.dtype))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | None = None, generator: torch.Generator | None = None,
                 pixel_values: torch.Tensor | None = None, image_grids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill the prompt once, then decode token by token over the hybrid cache.

        input_ids: [B, T] -> [B, T + n] with n <= max_new_tokens (fewer when every row hit eos_token_id).
        Greedy by default; do_sample=True samples with temperature / top-k / top-p.
        pixel_values / image_grids: the prompt's images (see forward); they are used in the prefill only.
        attention_mask [B, T]: real tokens of prompts of unequal length, left- or right-padded. Each row is
        then generated alone (padded.py) and the output is left-padded: out[:, T:] are the new tokens, and
        a row that stopped at eos_token_id earlier than another is filled with it. Batching prompts of
        unequal length into one forward (ragged batching) is the serving engine's job (latentmoe_lab.serving).
        Raises finite.NonFiniteError, naming the first layer that went non-finite, on NaN / inf logits.
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
        spans = None if attention_mask is None else prompt_spans(attention_mask, input_ids)
        options = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                       top_p=top_p, eos_token_id=eos_token_id, generator=generator)
        if spans is not None:
            return self._generate_rows(input_ids, spans, pixel_values, image_grids, options)
        tokens = input_ids
        if max_new_tokens == 0:
            return tokens
        cache = self.new_cache()
        logits = self._checked_logits(self(input_ids, pixel_values, cache, image_grids), "generate prefill")
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = _pick_next(logits, do_sample, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self._checked_logits(self(next_token[:, None], cache=cache), f"generate step {step + 1}")
        return tokens

    def _checked_logits(self, output: CausalLMOutput, where: str) -> torch.Tensor:
        """The last position's logits [B, vocab], after checking all of them are finite (one host sync)."""
        check_finite_logits(output.logits, output.finite, self.config.layer_types, where)
        return output.logits[:, -1]

    def _generate_rows(self, input_ids: torch.Tensor, spans: list[tuple[int, int]], pixel_values, image_grids,
                       options: dict) -> torch.Tensor:
        """generate for each padded row alone (its real tokens and images), left-padded back together."""
        per_image = None
        if pixel_values is not None:
            if self.vision is None:
                raise ValueError("pixel_values: this model has no vision tower (config.vision is None)")
            if image_grids is None:
                raise ValueError("image_grids: required with pixel_values, one (rows, cols) of patches per image")
            self.vision.check_inputs(pixel_values, image_grids)
            per_image = self.vision.tokens_per_image(image_grids)
        image_token = None if self.config.vision is None else self.config.vision.image_token_id
        images = split_images(input_ids, spans, image_token, pixel_values, image_grids, per_image)
        rows, pads = [], []
        for row, ((start, end), (row_pixels, row_grids)) in enumerate(zip(spans, images)):
            alone = self.generate(input_ids[row:row + 1, start:end], pixel_values=row_pixels,
                                  image_grids=row_grids, **options)
            rows.append(alone[0])
            pads.append(torch.cat([input_ids[row, :start], input_ids[row, end:]]))
        return left_pad_rows(rows, pads, options["eos_token_id"])

    def _check_input_ids(self, input_ids: torch.Tensor, cache: HybridCache | None) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError("input_ids: expected an int64 tensor [B, T]")
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected shape [B, T] with B >= 1 and T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids: token ids must lie in [0, {self.config.vocab_size})")
        if cache is not None:
            if not isinstance(cache, HybridCache):
                raise TypeError(f"cache: expected a HybridCache (model.new_cache()), got {type(cache).__name__}")
            cache.check_usable(self.config, input_ids.shape[0])
        past = 0 if cache is None else cache.seq_len
        if past + input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"input_ids: sequence length {past + input_ids.shape[1]} exceeds "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")


def _check_right_padded(attention_mask: torch.Tensor | None, input_ids: torch.Tensor,
                        cache: HybridCache | None) -> None:
    """forward takes a mask whose padding (if any) follows each row's real tokens, and none with a cache."""
    if attention_mask is None:
        return
    spans = prompt_spans(attention_mask, input_ids)
    if spans is None:
        return
    if cache is not None:
        raise ValueError("attention_mask: padded rows cannot continue a cache (the pads would enter it); "
                         "use model.generate(input_ids, attention_mask=...)")
    left = next((row for row, (start, _) in enumerate(spans) if start > 0), None)
    if left is not None:
        raise ValueError(f"attention_mask: row {left} is left-padded; in a forward the pads would enter that "
                         f"row's KDA state and DSA keys. Right-pad it, or use model.generate(..., attention_mask=)")


def _refuse_if_too_large(config: ModelConfig) -> None:
    """Refuse, before allocating anything, a model whose weights certainly exceed the device's memory.

    The count is a lower bound from the config alone (embeddings, LM head, dense and routed experts'
    weights: 98% of k3-2.8t), so a model that fits is never refused; it costs no build (a meta-device
    build would import sympy on its first init call, seconds on every first model). Exact counts per
    component: latentmoe_lab.meta.count_parameters. Under a meta-device context (`with torch.device("meta"):`,
    or accelerate's init_empty_weights, as meta.py and from_pretrained build) nothing is allocated, so
    anything may be built there.
    """
    if _parameters_land_on_meta():
        return
    device = torch.empty(()).device
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "cpu":
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:  # a device whose memory we do not know
        return
    needed = _min_parameters(config) * torch.empty((), dtype=torch.get_default_dtype()).element_size()
    if needed > limit:
        raise ValueError(
            f"config: {config.name!r} needs more than {needed / 1e9:,.1f} GB of {torch.get_default_dtype()} "
            f"weights, more than the {limit / 1e9:,.1f} GB of {device.type} memory here; nothing was allocated. "
            f"Build it on the meta device (with torch.device('meta'): LatentMoEForCausalLM(config); sizes from "
            f"latentmoe_lab.meta.count_parameters) or load weights placed by a device map: "
            f"LatentMoEForCausalLM.from_pretrained(path, device_map=...)")


def _parameters_land_on_meta() -> bool:
    """True under torch.device("meta") and under init_empty_weights (which moves each registered parameter)."""
    probe = nn.Module()
    probe.register_parameter("weight", nn.Parameter(torch.empty(0)))
    return probe.weight.is_meta


def _min_parameters(config: ModelConfig) -> int:
    """A lower bound on the parameter count: embeddings, LM head, dense SwiGLUs, routed and shared experts."""
    d, moe = config.hidden_size, config.moe
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    dense = config.first_dense_layers * 3 * d * config.dense_intermediate_size
    moe_layers = config.num_layers - config.first_dense_layers
    experts = 3 * moe.expert_intermediate_size * (moe.num_experts * moe.latent_size + moe.num_shared_experts * d)
    return embeddings + dense + moe_layers * experts


IGNORE_INDEX = -100


def _check_labels(labels: torch.Tensor | None, input_ids: torch.Tensor, vocab_size: int) -> None:
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError("labels: expected an int64 tensor [B, T] aligned with input_ids")
    if isinstance(input_ids, torch.Tensor) and labels.shape != input_ids.shape:
        raise ValueError(f"labels: expected the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    kept = labels[labels != IGNORE_INDEX]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size):
        raise ValueError(f"labels: must be token ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored)")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   sequence_start: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32: logits [B, T, V] at t against labels [B, T] at t + 1.

    Targets equal to -100, and targets that open a packed sequence (sequence_start[b, t] == t), are ignored;
    with no target left the loss is 0 (with a graph), not NaN.
    """
    targets = labels[:, 1:].long()
    if sequence_start is not None:
        positions = torch.arange(1, labels.shape[1], device=labels.device)
        targets = targets.masked_fill(sequence_start[:, 1:].to(labels.device) == positions, IGNORE_INDEX)
    flat_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    kept = flat_targets != IGNORE_INDEX
    summed = torch.nn.functional.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / kept.sum().clamp(min=1)


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
