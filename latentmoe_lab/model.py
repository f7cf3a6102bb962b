"""LatentMoEForCausalLM: embeddings, hybrid KDA / Gated DSA blocks with dense or LatentMoE FFNs, LM head.

Images (docs/design.md §1.5): the vision tower turns pixel_values into one feature per image placeholder token;
the features replace those tokens' embeddings in order, and from there on image and text tokens share
every attention layer and every expert.

Block i (pre-norm residual):
    h = x + Attn_i(RMSNorm(x))          Attn_i = KDA or Gated DSA, from config.layer_types[i]
    y = h + FFN_i(RMSNorm(h))           FFN_i  = dense SwiGLU for i < first_dense_layers, else LatentMoE
With config.attn_res_block_size the sums become Block AttnRes mixes over depth (layers/attn_res.py, §18).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from latentmoe_lab.cache import HybridCache
from latentmoe_lab.checkpoint import save_checkpoint
from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.finite import all_finite
from latentmoe_lab.generation import GenerationMixin
from latentmoe_lab.layers.attn_res import AttnResStream, BlockAttnRes, DepthMix, stream_tensor
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.dsa_indexer import link_shared_indexers
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import sequence_start_from_cu_seqlens
from latentmoe_lab.layers.vision import VisionTower
from latentmoe_lab.lm_loss import causal_lm_loss, check_labels
from latentmoe_lab.model_inputs import check_input_ids, check_placeholder_spans, check_right_padded
from latentmoe_lab.mtp import MultiTokenPredictor
from latentmoe_lab.paged_pools import PagedPools
from latentmoe_lab.pretrained import load_pretrained
from latentmoe_lab.size_guard import refuse_if_too_large


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
                 moe: bool | None = None, attn_res: bool = True):
        """attention_type / moe: None = from config for layer_idx (the MTP head's blocks set both, mtp.py).
        attn_res False: plain residuals even with config.attn_res_block_size (the MTP head's blocks)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx] if attention_type is None else attention_type
        self.is_moe = config.is_moe_layer(layer_idx) if moe is None else moe
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = KimiDeltaAttention(config) if self.attention_type == KDA else GatedDSA(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense_situ = ((config.moe.situ_beta_gate, config.moe.situ_beta_up) if config.dense_activation == "situ"
                      else None)
        self.ffn = (LatentMoE(config) if self.is_moe
                    else SwiGLU(config.hidden_size, config.dense_intermediate_size, situ_betas=dense_situ))
        self.attn_res = (BlockAttnRes(config.hidden_size, config.rms_norm_eps, layer_idx, config.attn_res_block_size)
                         if attn_res and config.attn_res_block_size is not None else None)

    def forward(self, x: torch.Tensor, layer_cache=None, sequence_start: torch.Tensor | None = None,
                batch: ForwardBatch | None = None, pool=None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]. sequence_start [B, T]: packed sequences (layers/packed.py).

        batch + pool (this layer's DSAPool or KDAPool): the paged serving step, x [1, total, hidden].
        With Block AttnRes (config.attn_res_block_size) x is the AttnResStream and so is the result.
        """
        if self.attn_res is not None:
            def attention(h: torch.Tensor) -> torch.Tensor:
                return self.attn(self.attn_norm(h), layer_cache, sequence_start=sequence_start, batch=batch, pool=pool)

            return self.attn_res.run(x, attention, lambda h: self.ffn(self.ffn_norm(h)))
        x = x + self.attn(self.attn_norm(x), layer_cache, sequence_start=sequence_start, batch=batch, pool=pool)
        return x + self.ffn(self.ffn_norm(x))


class LatentMoEForCausalLM(GenerationMixin, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config = config
        refuse_if_too_large(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_layers))
        link_shared_indexers(config, [layer.attn for layer in self.layers])  # dsa.index_share_every
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Block AttnRes: the last mix over the stream, whose output the final norm reads (layers/attn_res.py)
        self.attn_res_final = (DepthMix(config.hidden_size, config.rms_norm_eps)
                               if config.attn_res_block_size is not None else None)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=config.initializer_range)
        self.vision = VisionTower(config) if config.vision is not None else None
        # mtp_depth 0: no attribute in the state dict, the checkpoint of a model without the head
        self.mtp = (MultiTokenPredictor(config, lambda idx: DecoderBlock(config, idx, attention_type=DSA, moe=False,
                                                                        attn_res=False))
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
        return save_checkpoint(self, path, max_shard_size)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device_map=None,
                        offload_folder=None, verify_checksums: bool = True) -> "LatentMoEForCausalLM":
        """Load a save_pretrained (or save_quantized) directory through accelerate (empty weights, then load
        and dispatch), every file checked first; verify_checksums=False skips the SHA-256 of each file.
        A quantized directory loads as quant.checkpoint.load_quantized would (pretrained.py)."""
        return load_pretrained(cls, path, dtype=dtype, device_map=device_map, offload_folder=offload_folder,
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
        check_labels(labels, input_ids, self.config.vocab_size)
        check_input_ids(self.config, input_ids, cache)
        check_right_padded(attention_mask, input_ids, cache)
        sequence_start = None
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: the packed layout (cu_seqlens) needs one row [1, total], "
                                 f"got shape {tuple(input_ids.shape)}")
            if cache is not None:
                raise ValueError("cu_seqlens: packed sequences cannot continue a cache; pass cache=None")
            sequence_start = sequence_start_from_cu_seqlens(cu_seqlens, input_ids.shape[1]).to(input_ids.device)
        x = self.start_stream(self._embed(input_ids, pixel_values, image_grids))
        finite = [all_finite(stream_tensor(x))]
        try:
            for i, block in enumerate(self.layers):
                x = block(x, None if cache is None else cache[i], sequence_start)
                finite.append(all_finite(stream_tensor(x)))
        except BaseException as error:  # the layers before i hold the new tokens, the rest do not
            if cache is not None:
                cache.invalidate(f"{type(error).__name__} in layer {i} while appending {input_ids.shape[1]} "
                                 f"tokens at position {cache.seq_len}")
            raise
        if cache is not None:
            cache.seq_len += input_ids.shape[1]
        hidden = self.end_stream(x)
        x = self.norm(hidden)
        finite.append(all_finite(x))
        logits = self.lm_head(x).float()
        finite = torch.stack(finite)
        if labels is None:
            return CausalLMOutput(logits=logits, cache=cache, finite=finite)
        mtp_loss = None if self.mtp is None else self.mtp.loss(hidden, input_ids, labels, self.embed_tokens,
                                                                 self.lm_head, sequence_start)
        return CausalLMOutput(logits=logits, cache=cache, loss=causal_lm_loss(logits, labels, sequence_start),
                              aux_loss=self.router_losses(), finite=finite, mtp_loss=mtp_loss)

    def start_stream(self, x: torch.Tensor):
        """The embeddings [B, T, hidden] as the residual stream: x itself, or with Block AttnRes the
        AttnResStream whose only block is the embedding (layers/attn_res.py)."""
        return x if self.config.attn_res_block_size is None else AttnResStream.start(x)

    def end_stream(self, x) -> torch.Tensor:
        """The hidden state after the last layer [..., hidden], before the final norm: x itself, or the
        final AttnRes mix over the stream's candidates."""
        return self.attn_res_final(x.candidates()) if isinstance(x, AttnResStream) else x

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
        check_input_ids(self.config, input_ids, None)
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
        x = self.start_stream(x)
        finite = [all_finite(stream_tensor(x))]
        for i, block in enumerate(self.layers):
            x = block(x, batch=batch, pool=pools.layer(i))
            finite.append(all_finite(stream_tensor(x)))
        x = self.end_stream(x)
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
        check_placeholder_spans(placeholders, self.vision.tokens_per_image(image_grids), image_grids)
        features = self.encode_images(pixel_values, image_grids)  # [M, hidden], one per placeholder, in order
        # masked_scatter fills the masked positions in row-major (b, t) order: the i-th placeholder gets feature i
        return x.masked_scatter(placeholders[..., None], features.to(x.dtype))
