"""A ServiceConfig -> the model it serves (docs/design.md §6.1, §10).

model.checkpoint (or --checkpoint) loads a save_pretrained directory (safetensors through accelerate);
model.preset builds that preset with random weights seeded by model.seed, so a restart reloads the
very same weights. model.checkpoint_if_present (configs/service-cpu.yaml: checkpoints/mini-stdlib, which
`make model` builds) is served instead of the preset when it exists. model.dtype fp32 / bf16 / fp16 casts
the weights; fp8 is a planning format only.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.serving import ServiceConfig
from latentmoe_lab.trained_model import announce, no_checkpoint_line, trained_or_none

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def with_checkpoint(config: ServiceConfig, checkpoint: str | None) -> ServiceConfig:
    """The config `serve` runs: model.checkpoint set to --checkpoint, or else to model.checkpoint_if_present when
    that directory holds a checkpoint (model.preset cleared, the served name the directory's, as /v1/models
    then shows); otherwise the config unchanged."""
    if checkpoint is None:
        fallback = config.model.checkpoint_if_present
        if fallback is None or trained_or_none(fallback) is None:
            return config
        checkpoint = fallback
    model = dataclasses.replace(config.model, checkpoint=str(checkpoint), preset=None, checkpoint_if_present=None,
                                name=Path(checkpoint).resolve().name)
    updated = dataclasses.replace(config, model=model)
    updated.validate()
    return updated


def source_line(config: ServiceConfig) -> str:
    """What `serve` says it runs: the checkpoint (with its training), or the random preset and why."""
    m = config.model
    if m.checkpoint is not None:
        return announce(m.checkpoint)
    if m.checkpoint_if_present is not None:
        return no_checkpoint_line(m.checkpoint_if_present, m.preset)
    return f"serving a random {m.preset} model (seed {m.seed})"


def load_model(config: ServiceConfig) -> LatentMoEForCausalLM:
    m = config.model
    if m.dtype not in TORCH_DTYPES:
        raise ValueError(f"model.dtype: {m.dtype!r} is a planning format here; serve with one of "
                         f"{list(TORCH_DTYPES)}")
    dtype = TORCH_DTYPES[m.dtype]
    if m.checkpoint is not None:
        return LatentMoEForCausalLM.from_pretrained(m.checkpoint, dtype=dtype).eval()
    if m.preset is None:
        raise ValueError("model.preset: give model.preset or model.checkpoint (or --checkpoint DIR)")
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(m.seed)  # the same seed gives the same weights on every (re)load
        model = LatentMoEForCausalLM(ModelConfig.from_preset(m.preset))
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype).eval()
