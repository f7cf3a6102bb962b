"""SimDevice: a simulated new accelerator, in pure Python on top of the CPU (docs/design.md §16).

    with SimDevice("bf16-accum-fp32", mode="strict", model=model):
        model(input_ids)                       # every op is checked against the op table and the profile

Every op the model dispatches inside the block (ATen ops, and torch.ops.latentmoe custom ops as one op
each) passes through `__torch_dispatch__` of this TorchDispatchMode. It is supported when its name is in
the op table (porting/op_table.py) and its tensors' dtypes and limits fit the numerics profile. A
supported op runs with the profile's numerics (mm-class inputs rounded to bf16 with fp32 accumulation,
saturating fp8 casts); an unsupported one, in "strict" mode, raises UnsupportedOperator naming the op,
its shapes and the module that called it; in "report" mode it falls back to the CPU reference and is
counted (`coverage()`): which ops, how often, in which layers, and how many host round trips the
fallbacks cost (each maximal run of consecutive fallbacks is one trip to the host and back).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from latentmoe_lab.porting.recorder import op_name, tensors_of
from latentmoe_lab.porting.module_path import ModuleTracker, layer_type
from latentmoe_lab.porting.op_table import FULL_OP_TABLE, MATMUL_OPS, check_op_names, resolve_profile

MODES = ("strict", "report")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_BOOKKEEPING = ("profiler.",)  # record_function markers: no device work
# where an mm-class op's two factors start among its positional arguments (the ops of MATMUL_OPS)
_FACTOR_POSITION = {"aten.mm": 0, "aten.bmm": 0, "aten._grouped_mm": 0,
                    "aten.addmm": 1, "aten.baddbmm": 1, "aten.baddbmm_": 1}


class UnsupportedOperator(RuntimeError):
    """An op the simulated device cannot run: op name, input shapes, module path and the rule it broke."""

    def __init__(self, op: str, shapes: tuple, module: str, reason: str):
        self.op, self.shapes, self.module, self.reason = op, shapes, module, reason
        super().__init__(f"{op} is not supported by the simulated device ({reason}); called from module "
                         f"{module or '<top level>'} with input shapes {list(shapes)}")


@dataclass
class Coverage:
    """What a report-mode run fell back on. missing: op -> calls; layers: op -> layer types (or paths)."""

    ops_run: int
    missing: dict[str, int]
    reasons: dict[str, str]
    layers: dict[str, list[str]]
    host_round_trips: int
    host_syncs: int

    @property
    def supported_fraction(self) -> float:
        return 1.0 - sum(self.missing.values()) / max(self.ops_run, 1)

    def summary(self) -> str:
        lines = [f"{self.ops_run} ops, {self.supported_fraction:.1%} native; {self.host_round_trips} host round "
                 f"trips for fallbacks, {self.host_syncs} host syncs (.item())"]
        for op, count in sorted(self.missing.items(), key=lambda kv: -kv[1]):
            lines.append(f"  missing {op:<32} x{count:<5} {self.reasons[op]}; in {', '.join(self.layers[op])}")
        return "\n".join(lines)


class SimDevice(TorchDispatchMode):
    """The simulated accelerator as a dispatch mode over CPU tensors.

    profile: a NumericsProfile or a name in op_table.PROFILES. op_table: op names the device implements
    (default FULL_OP_TABLE). mode: "strict" (raise on the first unsupported op) or "report" (fall back
    and count). model: the module whose paths name where ops come from (optional).
    """

    def __init__(self, profile="fp32", op_table=None, mode: str = "strict", model: nn.Module | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
        self.profile = resolve_profile(profile)
        self.op_table = FULL_OP_TABLE if op_table is None else check_op_names(op_table)
        self.mode, self.model = mode, model
        self._tracker = ModuleTracker(model) if model is not None else None
        self.ops_run = self.host_syncs = self.host_round_trips = 0
        self._missing: Counter = Counter()
        self._reasons: dict[str, str] = {}
        self._layers: dict[str, set] = defaultdict(set)
        self._previous_fell_back = False

    def __enter__(self):
        if self._tracker is not None:
            self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
        return result

    # -------------------------------------------------------------------------------------- checks
    def unsupported_reason(self, name: str, func, args, kwargs) -> str | None:
        """Why the device cannot run this call (None when it can). Checks the inputs' dtypes and limits."""
        if name not in self.op_table:
            return "not in the op table"
        for tensor in tensors_of((args, kwargs)):
            if tensor.dtype not in self.profile.dtype_set:
                return f"{str(tensor.dtype).replace('torch.', '')} tensors are not in profile {self.profile.name!r}"
        requested = kwargs.get("dtype") if name in ("aten._to_copy", "aten.to") else None
        if requested is not None and requested not in self.profile.dtype_set:
            return f"casts to {str(requested).replace('torch.', '')}, not in profile {self.profile.name!r}"
        if name == "aten.topk" and self.profile.topk_max_k is not None and args[1] > self.profile.topk_max_k:
            return f"k={args[1]} exceeds the device's top-k limit {self.profile.topk_max_k}"
        return None

    def _output_reason(self, out) -> str | None:
        for tensor in tensors_of(out):
            if tensor.dtype not in self.profile.dtype_set:
                return f"returns {str(tensor.dtype).replace('torch.', '')}, not in profile {self.profile.name!r}"
        return None

    # ------------------------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name.startswith(_BOOKKEEPING):
            return func(*args, **kwargs)
        self.ops_run += 1
        if name == "aten._local_scalar_dense":
            self.host_syncs += 1
        reason = self.unsupported_reason(name, func, args, kwargs)
        out = func(*args, **kwargs) if reason else self._run_native(name, func, args, kwargs)
        reason = reason or self._output_reason(out)
        if reason is None:
            self._previous_fell_back = False
            return out
        module = self._tracker.current if self._tracker else ""
        if self.mode == "strict":
            raise UnsupportedOperator(name, tuple(tuple(t.shape) for t in tensors_of((args, kwargs))), module, reason)
        self._missing[name] += 1
        self._reasons.setdefault(name, reason)
        self._layers[name].add(layer_type(module, self.model) or module or "<top level>" if self.model is not None
                               else "<no model given>")
        if not self._previous_fell_back:
            self.host_round_trips += 1
        self._previous_fell_back = True
        return out

    def _run_native(self, name: str, func, args, kwargs):
        """The op with the profile's numerics."""
        low = self.profile.matmul_inputs
        if name in MATMUL_OPS and low is not None:
            rounding = getattr(torch, low)

            def rounded(t):  # products of rounded inputs are exact in fp32: only the inputs lose bits
                return t.to(rounding).to(t.dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
            # Only the two factors are rounded. The added term (addmm's / baddbmm's self) is the fp32
            # accumulator, and rounding it, or an `out=` buffer, would hand the op a copy: an in-place
            # baddbmm_ or an out= call would then write the copy and leave the caller's tensor as it was
            # (uninitialised memory for a torch.empty buffer).
            first = _FACTOR_POSITION[name]
            args = (*args[:first], *(rounded(a) for a in args[first:first + 2]), *args[first + 2:])
            return func(*args, **kwargs)
        if name == "aten._to_copy" and kwargs.get("dtype") == torch.float8_e4m3fn and args[0].is_floating_point():
            source = args[0]
            if self.profile.fp8_saturate:
                source = source.clamp(-FP8_MAX, FP8_MAX)
            else:  # no saturation: out of range is NaN (e4m3fn has no inf)
                source = source.masked_fill(source.abs() > FP8_MAX, float("nan"))
            return func(source, *args[1:], **kwargs)
        return func(*args, **kwargs)

    def coverage(self) -> Coverage:
        return Coverage(self.ops_run, dict(self._missing), dict(self._reasons),
                        {op: sorted(where) for op, where in self._layers.items()}, self.host_round_trips,
                        self.host_syncs)


class SimDeviceCandidate(nn.Module):
    """An alignment candidate (latentmoe_lab.alignment.compare): `model` (shared, not copied) run on the
    simulated device with `profile`, in report mode (a missing op falls back rather than stopping the run).
    forward as the model's; `last_coverage` holds the last forward's coverage."""

    def __init__(self, model: nn.Module, profile="bf16-accum-fp32", op_table=None):
        super().__init__()
        self.model, self.profile = model, resolve_profile(profile)
        self.op_table = op_table
        self.name = f"sim:{self.profile.name}"
        self.last_coverage: Coverage | None = None

    def forward(self, *args, **kwargs):
        device = SimDevice(self.profile, self.op_table, mode="report", model=self.model)
        with device:
            out = self.model(*args, **kwargs)
        self.last_coverage = device.coverage()
        return out


def profile_candidates(model: nn.Module, op_table=None) -> dict[str, SimDeviceCandidate]:
    """Every numerics profile of op_table.PROFILES as an alignment candidate, by name."""
    from latentmoe_lab.porting.op_table import PROFILES

    return {name: SimDeviceCandidate(model, profile, op_table) for name, profile in PROFILES.items()}
