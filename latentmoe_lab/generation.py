"""generate(): prefill a prompt once, then decode token by token over the contiguous hybrid cache.

GenerationMixin is a base class of LatentMoEForCausalLM (model.py) and uses only what the model offers
(config, vision, new_cache, and calling the model); pick_next is the greedy / temperature / top-k / top-p choice.
Serving many requests at once (ragged batches over paged pools) is latentmoe_lab.serving's job.
"""
from __future__ import annotations

import torch

from latentmoe_lab.finite import check_finite_logits
from latentmoe_lab.model_inputs import check_input_ids
from latentmoe_lab.padded import left_pad_rows, prompt_spans, split_images


class GenerationMixin:
    """model.generate(...); the class that mixes it in is an nn.Module with config, vision and new_cache()."""

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
        check_input_ids(self.config, input_ids, None)
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
            next_token = pick_next(logits, do_sample, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self._checked_logits(self(next_token[:, None], cache=cache), f"generate step {step + 1}")
        return tokens

    def _checked_logits(self, output, where: str) -> torch.Tensor:
        """A CausalLMOutput -> its last position's logits [B, vocab], after checking that all of its logits are
        finite (one host sync)."""
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


def pick_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None,
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
