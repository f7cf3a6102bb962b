"""torch.compile for the decode step: compile_decode(model) / eager_decode(model).

A decode step feeds one token per row through every block. Its shapes are the same at every step
except the Gated DSA caches, which grow by one token a step; so the single-token forward of every KDA
layer (fixed-size state and conv tail, updated in place) and every MoE / dense FFN layer is compiled,
and the DSA layers stay eager (a graph per cache length would recompile every step). Inside the MoE
layers the routed experts' grouped matmul stays eager too (see compile_decode).

    compile_decode(model)                      # inductor (CPU: C++/OpenMP kernels; CUDA: Triton)
    compile_decode(model, backend="aot_eager") # graph capture only: checks tracing, fast to compile
    eager_decode(model)                        # back to the plain forward

Multi-token calls (prefill, training) keep the eager forward. The modules keep their parameters and
state_dict: only the instance's `forward` attribute is set (and deleted again by eager_decode).
Logits equal the eager ones to float rounding (tests/test_compiled.py).
"""
from __future__ import annotations

import functools

import torch

from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import LatentMoE

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@functools.cache
def _compiled(cls_forward, backend: str):
    """One compiled function per (class forward, backend): every layer of a class shares its graph."""
    return torch.compile(cls_forward, backend=backend, dynamic=False)


def _decode_modules(model) -> list[torch.nn.Module]:
    modules = []
    for block in model.layers:
        if isinstance(block.attn, KimiDeltaAttention):
            modules.append(block.attn)
        modules.append(block.ffn)
    return modules


def compile_decode(model, backend: str = "inductor"):
    """Route the single-token forward of the KDA and FFN/MoE layers of `model` through torch.compile; returns model."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"backend: must be one of {COMPILE_BACKENDS}, got {backend!r}")
    for module in _decode_modules(model):
        compiled = _compiled(type(module).forward, backend)
        eager = type(module).forward

        def forward(x, *args, _module=module, _compiled=compiled, _eager=eager, **kwargs):
            paged = kwargs.get("batch") is not None or kwargs.get("pool") is not None
            run = _compiled if x.shape[1] == 1 and not paged and not torch.is_grad_enabled() else _eager
            return run(_module, x, *args, **kwargs)

        module.forward = forward
        if isinstance(module, LatentMoE):
            # The grouped expert matmul (torch._grouped_mm) has no CPU fp32 rule for the fake tensors
            # the compiler traces with: the routed experts run eager between the compiled graphs.
            module.experts.forward = torch.compiler.disable(module.experts.forward)
    return model


def eager_decode(model):
    """Undo compile_decode: every module runs its class's forward again; returns model."""
    for module in _decode_modules(model):
        module.__dict__.pop("forward", None)
        if isinstance(module, LatentMoE):
            module.experts.__dict__.pop("forward", None)
    return model
