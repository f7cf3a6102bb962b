"""Save and load quantized LatentMoEForCausalLM checkpoints: save_quantized(model, dir), load_quantized(dir).

The format, for any model class, is quant/checkpoint_format.py; this module adds the default class, so it
sits above model.py (which reaches the format through pretrained.py without importing this module).
"""
from __future__ import annotations

from pathlib import Path

import torch

from latentmoe_lab.checkpoint_checks import QUANT_KEY
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.quant.checkpoint_format import load_quantized_as, read_quantized_config, save_quantized

__all__ = ["QUANT_KEY", "load_quantized", "read_quantized_config", "save_quantized"]


def load_quantized(path: str | Path, verify_checksums: bool = True) -> torch.nn.Module:
    """The quantized model saved at `path`, on the CPU, in eval mode, with every tensor exactly as saved.

    verify_checksums=False skips the SHA-256 of each file (for very large checkpoints; sizes are still checked).
    """
    return load_quantized_as(LatentMoEForCausalLM, path, verify_checksums=verify_checksums)
