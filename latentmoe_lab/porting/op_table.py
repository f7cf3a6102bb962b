"""The simulated device's declared op table and numerics profiles (docs/design.md §16), both editable.

FULL_OP_TABLE lists every op a forward, a training step's loss, generate and the alignment taps of the
model dispatch on CPU, plus the latentmoe custom ops: with it and the "fp32" profile the simulated device
runs everything natively. A port starts from a vendor's real list instead and lets strict mode say
what is missing. Names are "namespace.op" without the overload ("aten.mm", "latentmoe.kda_chunk").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MATMUL_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.baddbmm_", "aten._grouped_mm"})

FULL_OP_TABLE = frozenset({
    # contractions
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.baddbmm_", "aten._grouped_mm", "aten.convolution",
    "aten.linalg_solve_triangular",
    # elementwise and activations
    "aten.abs", "aten.add", "aten.sub", "aten.rsub", "aten.mul", "aten.mul_", "aten.addcmul", "aten.addcmul_",
    "aten.div", "aten.floor_divide",
    "aten.remainder",
    "aten.exp", "aten.log", "aten.pow", "aten.reciprocal", "aten.rsqrt", "aten.relu", "aten.sigmoid", "aten.silu",
    "aten.clamp", "aten.clamp_min", "aten.where", "aten.masked_fill", "aten.masked_fill_", "aten.isnan",
    "aten.eq", "aten.ne", "aten.ge", "aten.gt", "aten.le", "aten.lt",
    "aten.bitwise_and", "aten.bitwise_not", "aten.bitwise_or",
    # reductions, norms, softmax, scans
    "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.all", "aten.any",
    "aten.argmax", "aten._softmax", "aten._log_softmax", "aten.native_layer_norm", "aten.linalg_vector_norm",
    "aten.nll_loss_forward",
    "aten.cumsum", "aten.cumprod", "aten.tril",
    # selection, sorting, gather / scatter (custom work on most accelerators)
    "aten.topk", "aten.sort", "aten.gather", "aten.scatter_", "aten.scatter_add_", "aten.index", "aten.index_select",
    "aten.index_add_",
    "aten.embedding", "aten.bincount", "aten.nonzero",
    # layout, creation and copies
    "aten._to_copy", "aten._unsafe_view", "aten.alias", "aten.cat", "aten.clone", "aten.constant_pad_nd",
    "aten.copy_", "aten.detach", "aten.expand", "aten.flip", "aten.permute", "aten.select", "aten.slice",
    "aten.split", "aten.split_with_sizes", "aten.stack", "aten.t", "aten.transpose", "aten.unsqueeze", "aten.view",
    "aten.arange", "aten.eye", "aten.empty_like", "aten.new_empty", "aten.new_full", "aten.new_zeros", "aten.ones",
    "aten.zeros",
    "aten.zeros_like", "aten.ones_like", "aten.scalar_tensor", "aten.promote_types", "aten.lift_fresh",
    # a device-to-host read of one value (int(t), t.item()): supported, but counted as a host sync
    "aten._local_scalar_dense",
    # the model's fused paths (porting/custom_ops.py)
    "latentmoe.route_topk", "latentmoe.route_gate", "latentmoe.dispatch_plan", "latentmoe.grouped_matmul",
    "latentmoe.grouped_swiglu", "latentmoe.kda_chunk", "latentmoe.kda_decode_step", "latentmoe.index_topk",
    "latentmoe.sparse_attention",
})


def check_op_names(names) -> frozenset:
    """The names as a frozenset, after checking each is "namespace.op" of a registered operator."""
    checked = set()
    for name in names:
        namespace, _, op = name.partition(".") if isinstance(name, str) else ("", "", "")
        known = bool(op) and hasattr(getattr(torch.ops, namespace, None), op)
        if not known:
            raise ValueError(f"op_table: unknown op {name!r}; names are 'namespace.op' of a registered "
                             f"operator, e.g. 'aten.mm' or 'latentmoe.kda_chunk'")
        checked.add(name)
    return frozenset(checked)


def _dtype(name: str, where: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}; use torch's names, e.g. 'float32', 'bfloat16', 'int32'")
    return value


ALL_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "int32", "int16", "int8",
              "uint8", "bool")


@dataclass(frozen=True)
class NumericsProfile:
    """What the device computes and holds.

    matmul_inputs: None (exact fp32 products) or a dtype name ("bfloat16", "float16"): mm-class inputs are
    rounded to it and the products accumulate in fp32, as a tensor core does.
    dtypes: tensor dtypes the device holds; an op touching another one is unsupported.
    topk_max_k: the largest k its top-k takes (None: any).
    fp8_saturate: a cast to float8_e4m3fn clamps to +-448 first (hardware saturation) instead of NaN.
    """

    name: str
    matmul_inputs: str | None = None
    dtypes: tuple[str, ...] = ALL_DTYPES
    topk_max_k: int | None = None
    fp8_saturate: bool = True
    dtype_set: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.matmul_inputs is not None:
            _dtype(self.matmul_inputs, "matmul_inputs")
        object.__setattr__(self, "dtype_set", frozenset(_dtype(d, "dtypes") for d in self.dtypes))
        if self.topk_max_k is not None and (isinstance(self.topk_max_k, bool) or not isinstance(self.topk_max_k, int)
                                            or self.topk_max_k < 1):
            raise ValueError(f"topk_max_k: must be None or an integer >= 1, got {self.topk_max_k!r}")


PROFILES = {
    "fp32": NumericsProfile("fp32"),
    "bf16-accum-fp32": NumericsProfile("bf16-accum-fp32", matmul_inputs="bfloat16"),
    # a typical first-generation accelerator: no fp64, no int64 index tensors, a bounded top-k
    "npu-like": NumericsProfile("npu-like", matmul_inputs="bfloat16",
                                dtypes=tuple(d for d in ALL_DTYPES if d not in ("float64", "int64")), topk_max_k=1024),
}


def resolve_profile(profile) -> NumericsProfile:
    """A NumericsProfile, or the name of one in PROFILES."""
    if isinstance(profile, NumericsProfile):
        return profile
    if isinstance(profile, str) and profile in PROFILES:
        return PROFILES[profile]
    raise ValueError(f"profile: expected a NumericsProfile or one of {sorted(PROFILES)}, got {profile!r}")
