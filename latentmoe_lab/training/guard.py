"""Stop training at the first non-finite activation or gradient, naming the module that produced it.

A NaN spreads: one step after it appears in one layer, every router and every weight holds it, and
the loss curve only says "nan". The guard names the origin, in the step it happens:

- forward: a forward hook on every module checks its outputs. Hooks fire when a module returns, so
  the first hook that sees a non-finite value belongs to the innermost module that made it (its
  children, which ran before it, were finite).
- backward: a full backward hook on every module sees (grad wrt its outputs, grad wrt its inputs).
  The module is blamed when the gradient it received was finite and the one it passed on is not: that
  is where the backward pass turned finite into non-finite. A module that merely passes on a gradient
  that already was non-finite is not blamed.
- parameters: a post-accumulate hook on every parameter checks its .grad, and blames the owning module
  under the same rule (its received gradient was finite), since a weight gradient is made by the module's
  own backward. A parameter that a parent reads directly (its owner's forward never ran this step, as
  for the absorbed MLA up-projection) is left to the parent's backward hook.

    guard = NonFiniteGuard(model)     # hooks attached
    loss = model(ids, labels=ids).loss; loss.backward()   # raises NonFiniteError("... layers.2.attn ...")
    guard.remove()

The hooks read every tensor once (a reduction each): about 30% of a CPU step at the mini size. A
training loop therefore checks only the loss and the gradient norm each step, and when either is not
finite calls `replay_with_guard`, which runs the same step again (same weights, same batch, before the
optimizer moves anything) with the hooks on, and raises with the module's name.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

# Modules fed only integer inputs (the embedding) have no input gradient; torch warns that their full
# backward hook then sees output gradients only, which is all the guard needs from them.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs")


class NonFiniteError(FloatingPointError):
    """Raised by NonFiniteGuard; .module is the qualified module name, .phase "forward" or "backward"."""

    def __init__(self, message: str, module: str, phase: str, step: int | None):
        super().__init__(message)
        self.module, self.phase, self.step = module, phase, step


def _tensors(value) -> list[torch.Tensor]:
    """The floating tensors in a module output / grad tuple (None, ints and caches skipped)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for name in value.__dataclass_fields__ for t in _tensors(getattr(value, name))]
    return []


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


class NonFiniteGuard:
    """Hooks on every submodule of `model` (see the module docstring); `step` is reported in the error."""

    def __init__(self, model: nn.Module, check_forward: bool = True, check_backward: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        self.step: int | None = None
        self._handles = []
        self._received_bad: set[str] = set()  # modules whose incoming gradient was already non-finite
        self._ran: set[str] = set()  # modules whose forward ran in this step
        self.check_forward = check_forward
        modules = [(name, module) for name, module in model.named_modules() if name]
        for name, module in modules:
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            # An embedding takes integer ids: it has no input gradient to check (torch warns that such hooks
            # fire on outputs), and its output gradient is the next module's input gradient, checked there.
            if check_backward and not isinstance(module, nn.Embedding):
                self._handles.append(module.register_full_backward_pre_hook(self._grad_out_hook(name)))
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        if check_backward:
            for name, module in modules:
                for param_name, param in module.named_parameters(recurse=False):
                    if param.requires_grad:
                        self._handles.append(param.register_post_accumulate_grad_hook(
                            self._param_hook(name, param_name)))

    def start_step(self, step: int) -> None:
        """Call before each forward: sets the step the error reports and forgets the last backward."""
        self.step = step
        self._received_bad.clear()
        self._ran.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "NonFiniteGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ hooks
    def _raise(self, module: str, phase: str, what: str) -> None:
        where = "" if self.step is None else f" at step {self.step}"
        raise NonFiniteError(f"non-finite {what} in module '{module}' ({phase}){where}", module, phase, self.step)

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            self._ran.add(name)
            if self.check_forward and not _all_finite(_tensors(output)):
                self._raise(name, "forward", "activation")
        return hook

    def _grad_out_hook(self, name: str):
        def hook(module, grad_output):
            if not _all_finite(_tensors(grad_output)):
                self._received_bad.add(name)
        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            if name not in self._received_bad and not _all_finite(_tensors(grad_input)):
                self._raise(name, "backward", "input gradient")
        return hook

    def _param_hook(self, module_name: str, param_name: str):
        def hook(param):
            if (module_name in self._ran and module_name not in self._received_bad and param.grad is not None
                    and not _all_finite([param.grad])):
                self._raise(module_name, "backward", f"gradient of parameter '{param_name}'")
        return hook


def replay_with_guard(model: nn.Module, run_step, step: int) -> None:
    """Re-run `run_step()` (forward + backward of the failed step) under a NonFiniteGuard; always raises.

    Raises the guard's NonFiniteError naming the module, or, when this process's replay stays finite (in
    data-parallel runs the non-finite value may come from another process's gradients), a NonFiniteError
    that says so.
    """
    model.zero_grad(set_to_none=True)
    with NonFiniteGuard(model) as guard:
        guard.start_step(step)
        run_step()
    raise NonFiniteError(f"non-finite loss or gradient norm at step {step}, but replaying this process's part "
                         f"of the step stayed finite (another data-parallel process's gradients?)",
                         "(unknown)", "backward", step)
