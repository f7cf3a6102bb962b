"""A ServiceConfig -> the model it serves (docs/design.md §6.1, §10).

model.checkpoint (or --checkpoint) loads a save_pretrained directory (safetensors through accelerate);
model.preset builds that preset with random weights seeded by model.seed, so a restart reloads the
very same weights. model.checkpoint_if_present (configs/service-cpu.yaml: checkpoints/mini-stdlib, which
`make model` builds) is served instead of the preset when it exists. model.dtype fp32 / bf16 / fp16 casts
the weights; fp8 is a planning format only. A quantized checkpoint (`latentmoe-lab quantize`) serves as saved:
packed experts / linears and their scales are never cast, and model.dtype must name its other weights' dtype.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from latentmoe_lab.checkpoint_checks import CONFIG_NAME, QUANT_KEY, resolve_checkpoint_dir
from latentmoe_lab.checkpoint_integrity import read_json_file
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.server.settings import ServerSettings, load_service_file
from latentmoe_lab.serving import ServiceConfig
from latentmoe_lab.serving.service_plan import check_engine_plan, check_role_plans
from latentmoe_lab.trained_model import announce, no_checkpoint_line, trained_or_none
from latentmoe_lab.yaml_loader import errors_name_file

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


def resolve_service(path: str, checkpoint: str | None = None) -> tuple[ServiceConfig, ServerSettings]:
    """The one resolution of a service file for `serve`, `serve-bench` and `plan-service`: load_service_file
    (the server: section, a preset's engine plan, this host's limits, each P/D role's plan), then the model
    served (--checkpoint, else model.checkpoint_if_present when it is built: with_checkpoint), whose own config
    is planned the same way. So a file one of them accepts is one the others run, with the same model."""
    config, settings = load_service_file(path)
    config = with_checkpoint(config, checkpoint)
    if config.model.checkpoint is not None and is_quantized_checkpoint(config.model.checkpoint):
        config = forward_here(config)
    model_config = served_model_config(config)
    if config.model.checkpoint is not None and model_config is not None:
        with errors_name_file(path):
            check_engine_plan(config, model_config)
            if config.disaggregation.enabled:
                check_role_plans(config, model_config)
    return config, settings


def forward_here(config: ServiceConfig) -> ServiceConfig:
    """A quantized checkpoint's forward runs in the engine's process: its packed weights and scales do not travel
    to worker processes (they reload a plain state dict), so parallel.forward_process is turned off, with a
    line saying so, and parallel sizes above 1 are refused naming the key."""
    p = config.parallel
    for key in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size"):
        if getattr(p, key) > 1:
            raise ValueError(f"parallel.{key}: {config.model.checkpoint} is a quantized checkpoint, which serves in "
                             f"one process (its packed weights are not split over workers); set it to 1")
    if not p.forward_process:
        return config
    print(f"{config.model.checkpoint} is quantized: the forward runs in the server process "
          "(parallel.forward_process is for plain weights)", file=sys.stderr)
    return dataclasses.replace(config, parallel=dataclasses.replace(p, forward_process=False))


def served_model_config(config: ServiceConfig) -> ModelConfig | None:
    """The ModelConfig `serve` would run, read without loading weights: the checkpoint's config.json (a
    quantized one's too), else the preset's; None for a transformers directory (known once converted)."""
    if config.model.checkpoint is None:
        return None if config.model.preset is None else ModelConfig.from_preset(config.model.preset)
    directory = resolve_checkpoint_dir(config.model.checkpoint)
    data = read_json_file(directory / CONFIG_NAME)
    if not isinstance(data, dict) or "model_type" in data:
        return None
    data.pop(QUANT_KEY, None)
    return ModelConfig.from_dict(data)


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
                         f"{list(TORCH_DTYPES)} (a checkpoint from `latentmoe-lab quantize` serves as saved: its "
                         "packed weights stay packed, model.dtype is that of its other weights)")
    dtype = TORCH_DTYPES[m.dtype]
    if m.checkpoint is not None and is_quantized_checkpoint(m.checkpoint):
        return _quantized(m.checkpoint, m.dtype)
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


def is_quantized_checkpoint(path: str) -> bool:
    """A directory `latentmoe-lab quantize` wrote (its config.json holds the recipe)."""
    directory = resolve_checkpoint_dir(path)
    data = read_json_file(directory / CONFIG_NAME)
    return isinstance(data, dict) and QUANT_KEY in data


def _quantized(path: str, dtype_name: str) -> LatentMoEForCausalLM:
    """A quantized checkpoint as saved (packed weights and their scales are never cast); model.dtype must name
    the dtype of its other weights, which a cast would change under the scales' feet."""
    model = LatentMoEForCausalLM.from_pretrained(path).eval()
    held = model.embed_tokens.weight.dtype
    if held != TORCH_DTYPES[dtype_name]:
        name = {dtype: key for key, dtype in TORCH_DTYPES.items()}.get(held, str(held))
        raise ValueError(f"model.dtype: {path} is a quantized checkpoint whose unquantized weights are {name}; "
                         f"set model.dtype: {name} (its packed weights serve as saved), got {dtype_name}")
    return model
