"""Which module is running: a stack of module paths kept by forward hooks, and the layer type of a path.

Both the operator inventory and the simulated device attribute every dispatched op to the innermost
module whose forward is running (`ModuleTracker.current`, e.g. "layers.3.attn.indexer.wq") and to one
of LAYER_TYPES (`layer_type`). Ops a block runs outside its children (the residual adds) belong to the
block's attention type; the norm in front of a mixer belongs to that mixer.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

LAYER_TYPES = ("embedding", "kda", "gated_dsa", "latent_moe", "dense_ffn", "vision", "lm_head")


class ModuleTracker:
    """Forward pre/post hooks on every named submodule of `model`; `current` is the innermost running path.

        with ModuleTracker(model) as tracker:
            ...                      # inside any op: tracker.current
    """

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        self.model = model
        self.stack: list[str] = []
        self._handles = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def __enter__(self) -> "ModuleTracker":
        for name, module in self.model.named_modules():
            if not name:
                continue
            self._handles.append(module.register_forward_pre_hook(lambda m, args, path=name: self.stack.append(path)))
            self._handles.append(module.register_forward_hook(lambda m, args, out, path=name: self._pop(path),
                                                              always_call=True))
        return self

    @contextlib.contextmanager
    def inside(self, path: str) -> Iterator[None]:
        """Attribute the ops of the block to `path` (work a model does outside its modules, e.g. a final cast)."""
        self.stack.append(path)
        try:
            yield
        finally:
            self._pop(path)

    def _pop(self, path: str) -> None:
        if self.stack and self.stack[-1] == path:
            self.stack.pop()

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()


def layer_type(path: str, model: nn.Module) -> str:
    """A module path of LatentMoEForCausalLM -> one of LAYER_TYPES ("" for ops outside every module)."""
    parts = path.split(".") if path else []
    if not parts:
        return ""
    if parts[0] == "embed_tokens":
        return "embedding"
    if parts[0] in ("norm", "lm_head"):
        return "lm_head"
    if parts[0] == "vision":
        return "vision"
    if parts[0] != "layers" or len(parts) < 2:
        return ""
    block = model.layers[int(parts[1])]
    if len(parts) > 2 and parts[2] in ("ffn", "ffn_norm"):
        return "latent_moe" if block.is_moe else "dense_ffn"
    return "kda" if block.attention_type == "kda" else "gated_dsa"
