"""Refuse, before allocating anything, a model whose weights certainly exceed the memory of the device it
would be built on (LatentMoEForCausalLM.__init__ calls refuse_if_too_large first)."""
from __future__ import annotations

import os

import torch
from torch import nn

from latentmoe_lab.config import ModelConfig


def refuse_if_too_large(config: ModelConfig) -> None:
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
