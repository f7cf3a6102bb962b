"""The checks of LatentMoEForCausalLM's inputs that need more than a line: token ids against the config and the
cache, attention masks a forward can take, image placeholders against the vision features.

Each raises ValueError (TypeError for a wrong type) naming the argument and the rule, before any layer runs.
"""
from __future__ import annotations

import torch

from latentmoe_lab.cache import HybridCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.padded import prompt_spans


def check_input_ids(config: ModelConfig, input_ids: torch.Tensor, cache: HybridCache | None) -> None:
    """input_ids [B, T] int ids in [0, vocab_size), continuing `cache` (if any) within max_position_embeddings."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("input_ids: expected an int64 tensor [B, T]")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected shape [B, T] with B >= 1 and T >= 1, got {tuple(input_ids.shape)}")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size):
        raise ValueError(f"input_ids: token ids must lie in [0, {config.vocab_size})")
    if cache is not None:
        if not isinstance(cache, HybridCache):
            raise TypeError(f"cache: expected a HybridCache (model.new_cache()), got {type(cache).__name__}")
        cache.check_usable(config, input_ids.shape[0])
    past = 0 if cache is None else cache.seq_len
    if past + input_ids.shape[1] > config.max_position_embeddings:
        raise ValueError(f"input_ids: sequence length {past + input_ids.shape[1]} exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings})")


def check_right_padded(attention_mask: torch.Tensor | None, input_ids: torch.Tensor,
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


def check_placeholder_spans(placeholders: torch.Tensor, per_image: torch.Tensor, image_grids: torch.Tensor) -> None:
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
