"""torch.compile for the decode step: compile_decode(model) / eager_decode(model).

A decode step feeds one token per row through every block. Its shapes are the same at every step
except the Gated DSA caches, which grow by one token a step; so the single-token forward of every KDA
layer (fixed-size state and conv tail, updated in place) and every MoE / dense FFN layer is compiled,
and the DSA layers stay eager (a graph per cache length would recompile every step). Inside the MoE
layers the routed experts run as one opaque custom op (ops/grouped_experts.py).

    compile_decode(model)                      # inductor (CPU: C++/OpenMP kernels; CUDA: Triton)
    compile_decode(model, backend="aot_eager") # graph capture only: checks tracing, fast to compile
    eager_decode(model)                        # back to the plain forward

Multi-token calls (prefill) keep the eager forward. The modules keep their parameters and
state_dict: only the instance's `forward` attribute is set (and deleted again by eager_decode).
Logits equal the eager ones to float rounding (tests/test_compiled.py).

The training step (`latentmoe-lab train --compile`) is compiled per region, forward and, through AOT
autograd, backward (docs/design.md §9):

    compile_training(model)   # every KDA block whole; the FFN / MoE of every Gated DSA block
    eager_training(model)

One compiled function per class is shared by every layer of it (one graph per distinct layer shape, not
per layer). The input checks, embeddings, finite flags, LM head and loss stay eager around the regions,
and so do the Gated DSA attention layers (their top-k selection has a data-dependent shape). Only calls
with autograd on and no cache take the compiled regions: evaluation and generation run eager.
"""
from __future__ import annotations

import functools

import torch
from einops import rearrange

from latentmoe_lab.layers.kda import KimiDeltaAttention

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@functools.cache
def _compiled(cls_forward, backend):
    """One compiled function per (class forward, backend): every layer of a class shares its graph."""
    return torch.compile(cls_forward, backend=backend, dynamic=False)


def _check_backend(backend) -> None:
    if not (backend in COMPILE_BACKENDS or callable(backend)):
        raise ValueError(f"backend: must be one of {COMPILE_BACKENDS} or a torch.compile backend callable, "
                         f"got {backend!r}")


def _training_modules(model) -> list[torch.nn.Module]:
    return [block if isinstance(block.attn, KimiDeltaAttention) else block.ffn for block in model.layers]


def compile_training(model, backend="inductor"):
    """Route the training forward of every KDA block, and of every other block's FFN / MoE, through
    torch.compile (backward by AOT autograd); returns model. backend: a name or a torch.compile backend."""
    _check_backend(backend)
    # einops caches its backend per tensor type and dynamo guards on that cache's size: an eager call meeting
    # its first Parameter after the regions compiled (evaluation does) would recompile every region once.
    for probe in (torch.zeros(1), torch.nn.Parameter(torch.zeros(1))):
        rearrange(probe, "n -> n")
    modules = _training_modules(model)
    if any("forward" in module.__dict__ for module in modules + _decode_modules(model)):
        raise ValueError("model: already compiled (compile_decode or compile_training); undo that first")
    _route_forwards(modules, backend, _is_training_call)
    return model


def _is_training_call(x, args, kwargs) -> bool:
    # a cache, packed-sequence starts or a serving batch: eager (the compiled graphs assume none)
    extra = any(a is not None for a in args) or any(v is not None for v in kwargs.values())
    return torch.is_grad_enabled() and not extra


def _is_decode_call(x, args, kwargs) -> bool:
    paged = kwargs.get("batch") is not None or kwargs.get("pool") is not None
    return x.shape[1] == 1 and not paged and not torch.is_grad_enabled()


def _route_forwards(modules, backend: str, compiled_when) -> None:
    """Give each module a forward that runs its class's forward compiled when compiled_when(x, args, kwargs),
    eager otherwise (the instance attribute shadows the class's; popping it undoes this)."""
    for module in modules:
        compiled, eager = _compiled(type(module).forward, backend), type(module).forward

        def forward(x, *args, _module=module, _compiled=compiled, _eager=eager, **kwargs):
            run = _compiled if compiled_when(x, args, kwargs) else _eager
            return run(_module, x, *args, **kwargs)

        module.forward = forward


def eager_training(model):
    """Undo compile_training; returns model."""
    for module in _training_modules(model):
        module.__dict__.pop("forward", None)
    return model


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
    if any("forward" in module.__dict__ for module in _decode_modules(model) + _training_modules(model)):
        raise ValueError("model: already compiled (compile_decode or compile_training); undo that first")
    _route_forwards(_decode_modules(model), backend, _is_decode_call)
    return model


def eager_decode(model):
    """Undo compile_decode: every module runs its class's forward again; returns model."""
    for module in _decode_modules(model):
        module.__dict__.pop("forward", None)
    return model
