"""The model's fused paths as PyTorch custom operators (`torch.ops.latentmoe.*`, docs/design.md §16).

A vendor backend plugs in below the dispatcher: it implements these ops, and torch.export, torch.compile
and the simulated device (porting/sim_device.py) each see one node per call instead of the dozens of
ATen ops of its reference. Every op's default implementation is its plain reference twin in
latentmoe_lab.ops (backend="torch"); its fake implementation gives output shapes without data (meta device,
export, compile); the ops that train get a backward, itself a custom op (see `_make_vjp`). On CUDA, with
triton installed, the Triton kernels of latentmoe_kernels are registered as the implementation.

    route_topk(logits [N, E], bias [E]?, top_k, n_group, topk_group, scaling) -> weights [N, K] fp32, indices [N, K]
    route_gate(x [N, d], weight [E, d], bias [E]?, ...)  -> the same, the fp32 router matmul fused in front
    dispatch_plan(indices [N, K], num_experts)          -> order [N*K] int64 (stable expert-major), counts [E]
    grouped_matmul(x [M, D], w [E, D, F], offsets [E])  -> [M, F]
    grouped_swiglu(x [M, D], w13 [E, D, 2F], offsets [E], clamp?) -> silu(x w_gate) * (x w_up) [M, F]
    kda_chunk(q, k, v, g, beta, initial_state?, scale, chunk_size) -> o [B, T, H, V], final_state [B, H, K, V]
    kda_decode_step(state [B, H, K, V], q, k, v, g, beta [B, H, *], scale) -> o [B, H, V], new state (functional)
    index_topk(q_idx [B, T, HI, DI], k_idx [B, S, DI], w [B, T, HI], k, offset) -> positions [B, T, k]
    sparse_attention(q [B, T, H, D], k [B, S, G, D], v [B, S, G, DV], indices [B, T, k], scale) -> [B, T, H, DV]
"""
from __future__ import annotations

import importlib
import importlib.util
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from latentmoe_lab.ops import kda as kda_ops
from latentmoe_lab.ops import kda_decode, routing

# (the package re-exports a function of the same name, so the module is imported by its path)
sparse_ops = importlib.import_module("latentmoe_lab.ops.sparse_attention")

NAMESPACE = "latentmoe"


def _fresh(*outputs: torch.Tensor, inputs: tuple) -> tuple[torch.Tensor, ...]:
    """Outputs that share memory with an input are cloned: a custom op's outputs must not alias its inputs."""
    pointers = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    return tuple(o.clone() if o.numel() and o.untyped_storage().data_ptr() in pointers else o for o in outputs)


# ------------------------------------------------------------------------------------------- routing
@torch.library.custom_op(f"{NAMESPACE}::route_topk", mutates_args=())
def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return routing.route_topk(logits, top_k, bias, n_group, topk_group, True, scaling, backend="torch")


@route_topk.register_fake
def _(logits, bias, top_k, n_group, topk_group, scaling):
    return (logits.new_empty(logits.shape[0], top_k, dtype=torch.float32),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.int64))


def _route_gate_reference(x, weight, bias, top_k, n_group, topk_group, scaling):
    logits = F.linear(x.float(), weight.float())
    return routing.route_topk(logits, top_k, bias, n_group, topk_group, True, scaling, backend="torch")


@torch.library.custom_op(f"{NAMESPACE}::route_gate", mutates_args=())
def route_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
               topk_group: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _route_gate_reference(x, weight, bias, top_k, n_group, topk_group, scaling)


@route_gate.register_fake
def _(x, weight, bias, top_k, n_group, topk_group, scaling):
    return (x.new_empty(x.shape[0], top_k, dtype=torch.float32), x.new_empty(x.shape[0], top_k, dtype=torch.int64))


@torch.library.custom_op(f"{NAMESPACE}::dispatch_plan", mutates_args=())
def dispatch_plan(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    plan = routing.plan_dispatch(indices, num_experts)
    return plan.order, plan.counts


@dispatch_plan.register_fake
def _(indices, num_experts):
    return indices.new_empty(indices.numel(), dtype=torch.int64), indices.new_empty(num_experts, dtype=torch.int64)


# --------------------------------------------------------------------------------------- grouped GEMM
@torch.library.custom_op(f"{NAMESPACE}::grouped_matmul", mutates_args=())
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return routing.grouped_matmul(x, w, offsets, backend="torch")


@grouped_matmul.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op(f"{NAMESPACE}::grouped_swiglu", mutates_args=())
def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, offsets: torch.Tensor, clamp: float | None) -> torch.Tensor:
    return routing.grouped_swiglu(x, w13, offsets, clamp, backend="torch")


@grouped_swiglu.register_fake
def _(x, w13, offsets, clamp):
    return x.new_empty(x.shape[0], w13.shape[2] // 2)


# ------------------------------------------------------------------------------------------------ KDA
def _kda_chunk_reference(q, k, v, g, beta, initial_state, scale, chunk_size):
    o, state = kda_ops.kda_chunked(q, k, v, g, beta, scale, initial_state, True, chunk_size, backend="torch")
    return o, state


@torch.library.custom_op(f"{NAMESPACE}::kda_chunk", mutates_args=())
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None, scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _fresh(*_kda_chunk_reference(q, k, v, g, beta, initial_state, scale, chunk_size),
                  inputs=(q, k, v, g, beta, initial_state))


def _state_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


@kda_chunk.register_fake
def _(q, k, v, g, beta, initial_state, scale, chunk_size):
    batch, seq_len, heads, dim_k = q.shape
    return v.new_empty(batch, seq_len, heads, v.shape[-1]), q.new_empty(
        batch, heads, dim_k, v.shape[-1], dtype=_state_dtype(q, k, v, g, beta, initial_state))


@torch.library.custom_op(f"{NAMESPACE}::kda_decode_step", mutates_args=())
def kda_decode_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_state = state.clone()
    with torch.no_grad():  # the reference step advances in place; this op is inference-only (no autograd)
        o = kda_decode.kda_decode_step_(new_state, q, k, v, g, beta, scale)
    return o, new_state


@kda_decode_step.register_fake
def _(state, q, k, v, g, beta, scale):
    return v.new_empty(v.shape), torch.empty_like(state)


# ------------------------------------------------------------------------------------ DSA (sparse path)
@torch.library.custom_op(f"{NAMESPACE}::index_topk", mutates_args=())
def index_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    return sparse_ops.index_topk(q_idx, k_idx, w, k, offset, backend="torch")


@index_topk.register_fake
def _(q_idx, k_idx, w, k, offset):
    return q_idx.new_empty(q_idx.shape[0], q_idx.shape[1], k, dtype=torch.int64)


@torch.library.custom_op(f"{NAMESPACE}::sparse_attention", mutates_args=())
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float) -> torch.Tensor:
    return sparse_ops.sparse_attention(q, k, v, indices, scale, backend="torch")


@sparse_attention.register_fake
def _(q, k, v, indices, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1])


# ------------------------------------------------------------------------------------------- autograd
def _make_vjp(op, reference, differentiable: tuple[int, ...], float_outputs: tuple[int, ...]) -> None:
    """Give `op` a backward: a second custom op `<name>_vjp` whose reference runs torch.autograd through
    `reference` (the twin), so export and compile see the backward as one node too.

    differentiable: positions of the tensor arguments that get a gradient (the others get None);
    float_outputs: positions of the outputs that carry one (integer outputs such as indices do not).
    """
    name = op._name
    forward_schema = str(op._opoverload._schema)  # "latentmoe::name(Tensor x, int k) -> (Tensor, Tensor)"
    arguments = forward_schema[forward_schema.index("(") + 1:forward_schema.index(") ->")]
    grads = ", ".join(f"Tensor? grad_{i}" for i in float_outputs)
    schema = f"({arguments}, {grads}) -> Tensor[]"
    count = len(op._opoverload._schema.arguments)

    def gradients(args):
        inputs, output_grads = list(args[:count]), args[count:]
        with torch.enable_grad():
            for i in differentiable:
                inputs[i] = inputs[i].detach().requires_grad_()
            outputs = reference(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(outputs[i], g) for i, g in zip(float_outputs, output_grads) if g is not None]
            leaves = [inputs[i] for i in differentiable]
            found = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
        return [torch.zeros_like(leaf) if grad is None else grad for leaf, grad in zip(leaves, found)]

    def backward_impl(*args):
        # An op's implementation runs below the autograd dispatch key, where autograd is off for this
        # thread; a fresh thread has autograd on (and no dispatch mode), so the twin's graph is built there.
        with ThreadPoolExecutor(1) as worker:
            return worker.submit(gradients, args).result()

    vjp = torch.library.custom_op(f"{NAMESPACE}::{name}_vjp", backward_impl, mutates_args=(), schema=schema)
    vjp.register_fake(lambda *args: [torch.empty_like(args[i]) for i in differentiable])

    names = [argument.name for argument in op._opoverload._schema.arguments]

    def setup_context(ctx, inputs, output):
        for i, value in enumerate(inputs):  # a gradient that would silently be dropped is refused instead
            if i not in differentiable and isinstance(value, torch.Tensor) and value.requires_grad:
                raise ValueError(f"{names[i]}: latentmoe.{name} gives it no gradient; pass it detached "
                                 f"(the differentiable inputs are {[names[j] for j in differentiable]})")
        ctx.inputs = inputs  # tensors and scalars as called (the backward recomputes from them)

    def backward(ctx, *output_grads):
        selected = [output_grads[i] for i in float_outputs]
        found = vjp(*ctx.inputs, *selected)
        result = [None] * count
        for i, grad in zip(differentiable, found):
            result[i] = grad
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


_make_vjp(route_topk, lambda logits, bias, *rest: routing.route_topk(logits, rest[0], bias, *rest[1:3], True,
                                                                       rest[3], backend="torch"), (0,), (0,))
_make_vjp(route_gate, _route_gate_reference, (0, 1), (0,))
_make_vjp(grouped_matmul, lambda x, w, offsets: routing.grouped_matmul(x, w, offsets, impl="padded",
                                                                         backend="torch"), (0, 1), (0,))
_make_vjp(grouped_swiglu, lambda x, w13, offsets, clamp: routing.swiglu(
    *routing.grouped_matmul(x, w13, offsets, impl="padded", backend="torch").chunk(2, dim=-1), clamp), (0, 1), (0,))
_make_vjp(kda_chunk, _kda_chunk_reference, (0, 1, 2, 3, 4), (0, 1))
_make_vjp(sparse_attention, lambda q, k, v, indices, scale: sparse_ops.sparse_attention(
    q, k, v, indices, scale, backend="torch"), (0, 1, 2), (0,))

# ops whose backward is registered (the ones a training step runs through)
TRAINING_OPS = ("route_topk", "route_gate", "grouped_matmul", "grouped_swiglu", "kda_chunk", "sparse_attention")


# ------------------------------------------------------------------------------------- CUDA: Triton
def _register_triton_kernels() -> None:
    """The CUDA implementation of each op with a kernel: the same op with backend="auto", which takes the
    Triton kernel for CUDA tensors that need no gradient (ops/backend.py) and the reference otherwise."""
    route_topk.register_kernel("cuda")(
        lambda logits, bias, top_k, n_group, topk_group, scaling: routing.route_topk(
            logits, top_k, bias, n_group, topk_group, True, scaling, backend="auto"))
    grouped_matmul.register_kernel("cuda")(lambda x, w, offsets: routing.grouped_matmul(x, w, offsets))
    grouped_swiglu.register_kernel("cuda")(lambda x, w13, offsets, clamp: routing.grouped_swiglu(x, w13, offsets,
                                                                                                  clamp))
    kda_chunk.register_kernel("cuda")(lambda q, k, v, g, beta, initial_state, scale, chunk_size: _fresh(
        *kda_ops.kda_chunked(q, k, v, g, beta, scale, initial_state, True, chunk_size),
        inputs=(q, k, v, g, beta, initial_state)))
    index_topk.register_kernel("cuda")(lambda q_idx, k_idx, w, k, offset: sparse_ops.index_topk(
        q_idx, k_idx, w, k, offset))
    sparse_attention.register_kernel("cuda")(lambda q, k, v, indices, scale: sparse_ops.sparse_attention(
        q, k, v, indices, scale))


if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("latentmoe_kernels") is not None:
    _register_triton_kernels()

OPS = {name: getattr(torch.ops.latentmoe, name) for name in (
    "route_topk", "route_gate", "dispatch_plan", "grouped_matmul", "grouped_swiglu", "kda_chunk",
    "kda_decode_step", "index_topk", "sparse_attention")}
