"""Triton kernels for LatentMoE Lab, importable as `latentmoe_kernels`.

Kernels import only torch and triton. Each kernel family sits beside a plain-PyTorch
reference twin in `latentmoe_lab.ops`, and tests compare the two under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when the triton package can be imported (it may still lack a GPU to run on)."""
    return importlib.util.find_spec("triton") is not None
