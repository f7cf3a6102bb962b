"""Graph optimisation on an exported block: torch.fx passes with node and launch counts (docs/design.md §16).

    gm, inputs = export_block(model, layer=3, phase="prefill", tokens=37)
    report = optimize(gm, inputs)          # runs PASSES in order, each checked for parity
    print(report.table())

export_block exports one DecoderBlock with torch.export (the fused paths as custom ops, porting/swap.py):
prefill shapes are [1, tokens, hidden]; decode shapes are [tokens, 1, hidden], one new token per
sequence, without a cache (the exported graph of the step's arithmetic; the cache read is the caller's).

The passes work on the unlifted module (`ExportedProgram.module()`), each a plain function of the fx graph:
    remove_redundant_casts   `.to(dtype)` / `_to_copy` onto the dtype a value already has, `detach` in an
                             inference graph, and the metadata asserts the graph's own shapes already prove
    fuse_router              linear(x, W_r) feeding route_topk -> one latentmoe.route_gate
    fuse_swiglu              grouped_matmul -> chunk -> silu * up -> one latentmoe.grouped_swiglu
    fuse_elementwise         each chain of single-use pointwise ops -> one fused submodule (one launch)
A launch is a node that runs a kernel: views, getitem and shape bookkeeping are free.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass

import torch
from torch import fx

from latentmoe_lab.porting.swap import use_custom_ops

aten = torch.ops.aten
latentmoe = torch.ops.latentmoe

CASTS = {aten.to.dtype, aten._to_copy.default}
FREE = {"aten.view", "aten.reshape", "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.expand", "aten.permute",
        "aten.transpose", "aten.t", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.select", "aten.alias",
        "aten.sym_size", "aten._assert_scalar", "aten._assert_tensor_metadata", "aten.promote_types", "aten.detach"}
POINTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.sigmoid.default,
             aten.silu.default, aten.exp.default, aten.rsqrt.default, aten.reciprocal.default,
             aten.pow.Tensor_Scalar, aten.neg.default, aten.relu.default, aten.abs.default, aten.clamp.default,
             aten.rsub.Scalar}


def export_block(model, layer: int, phase: str = "prefill", tokens: int = 37, seed: int = 0):
    """(the exported block as an fx.GraphModule, its example input tuple). See the module docstring."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase: must be 'prefill' or 'decode', got {phase!r}")
    if not isinstance(layer, int) or not 0 <= layer < len(model.layers):
        raise ValueError(f"layer: must be an integer in [0, {len(model.layers)}), got {layer!r}")
    block = model.layers[layer]
    shape = (1, tokens, model.config.hidden_size) if phase == "prefill" else (tokens, 1, model.config.hidden_size)
    generator = torch.Generator().manual_seed(seed)
    weight = block.attn_norm.weight
    inputs = (torch.randn(shape, generator=generator).to(weight.dtype),)
    with torch.no_grad(), use_custom_ops(), warnings.catch_warnings():
        # LatentMoE keeps last-forward statistics as attributes; export warns that they are not buffers
        warnings.filterwarnings("ignore", message="The tensor attributes .* were assigned during export")
        exported = torch.export.export(block, inputs)
    return exported.module(), inputs


def _name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    return packet._qualified_op_name.replace("::", ".") if packet is not None else getattr(target, "__name__", "")


def count_nodes(gm: fx.GraphModule) -> int:
    return sum(node.op in ("call_function", "call_module") for node in gm.graph.nodes)


def count_launches(gm: fx.GraphModule) -> int:
    """Nodes that run a kernel: every call_module (a fused group) and every torch operator but the free ones
    (getitem and Python arithmetic on sizes are not operators)."""
    def runs_kernel(node: fx.Node) -> bool:
        if node.op == "call_module":
            return True
        return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                and _name(node) not in FREE)

    return sum(runs_kernel(node) for node in gm.graph.nodes)


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


# --------------------------------------------------------------------------------------------- passes
def remove_redundant_casts(gm: fx.GraphModule) -> int:
    """Drop casts to a value's own dtype, detach (inference graph) and asserts its metadata already proves."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        source = node.args[0] if node.args else None
        if node.target in CASTS:
            dtype = node.args[1] if node.target is aten.to.dtype else node.kwargs.get("dtype")
            extra = set(node.kwargs) - {"dtype"}
            if _val(source) is not None and dtype == _val(source).dtype and not extra:
                node.replace_all_uses_with(source)
                changed += 1
        elif node.target is aten.detach.default:
            node.replace_all_uses_with(source)
            changed += 1
        elif node.target is aten._assert_tensor_metadata.default and _val(source) is not None:
            value = _val(source)
            wanted = {"dtype": value.dtype, "device": value.device, "layout": value.layout}
            if all(node.kwargs.get(k, v) == v for k, v in wanted.items()):
                gm.graph.erase_node(node)
                changed += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return changed


def fuse_router(gm: fx.GraphModule) -> int:
    """route_topk(linear(x, W_r) used once, bias, ...) -> route_gate(x, W_r, bias, ...)."""
    changed = 0
    gm.graph.eliminate_dead_code()
    for node in list(gm.graph.nodes):
        if node.target is not latentmoe.route_topk.default:
            continue
        logits = node.args[0]
        if not (isinstance(logits, fx.Node) and logits.target is aten.linear.default and len(logits.users) == 1
                and (len(logits.args) < 3 or logits.args[2] is None)):
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(latentmoe.route_gate.default, (*logits.args[:2], *node.args[1:]))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        changed += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return changed


def _single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def fuse_swiglu(gm: fx.GraphModule) -> int:
    """grouped_matmul(x, w13, offsets) -> chunk(2, -1) -> silu(gate) * up  ->  grouped_swiglu(x, w13, offsets)."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.target is not latentmoe.grouped_matmul.default:
            continue
        chunk = _single_user(node)
        if chunk is None or chunk.target is not aten.chunk.default or tuple(chunk.args[1:]) != (2, -1):
            continue
        parts = {user.args[1]: user for user in chunk.users if user.target is operator.getitem}
        if set(parts) != {0, 1} or len(chunk.users) != 2:
            continue
        silu, product = _single_user(parts[0]), _single_user(parts[1])
        if (silu is None or silu.target is not aten.silu.default or product is None
                or product.target is not aten.mul.Tensor or set(product.args) != {silu, parts[1]}
                or _single_user(silu) is not product):
            continue
        with gm.graph.inserting_before(product):
            fused = gm.graph.call_function(latentmoe.grouped_swiglu.default, (*node.args, None))
        fused.meta = dict(product.meta)
        product.replace_all_uses_with(fused)
        changed += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return changed


def fuse_elementwise(gm: fx.GraphModule) -> int:
    """Each maximal chain of pointwise nodes, each used only by the next, becomes one call_module."""
    changed = 0
    chained: set = set()
    for start in list(gm.graph.nodes):
        if start.target not in POINTWISE or start in chained:
            continue
        chain = [start]
        while (user := _single_user(chain[-1])) is not None and user.target in POINTWISE:
            chain.append(user)
        if len(chain) < 2:
            continue
        chained.update(chain)
        _replace_with_submodule(gm, chain, f"fused_elementwise_{changed}")
        changed += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return changed


def _replace_with_submodule(gm: fx.GraphModule, chain: list[fx.Node], name: str) -> None:
    """Move `chain` (each node feeding the next) into a GraphModule `name` called once where it ended."""
    inner, mapping, outside = fx.Graph(), {}, []
    inside = set(chain)
    for node in chain:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in mapping:
                mapping[arg] = inner.placeholder(f"in_{len(outside)}")
                outside.append(arg)
        mapping[node] = inner.node_copy(node, lambda n: mapping[n])
    inner.output(mapping[chain[-1]])
    gm.add_submodule(name, fx.GraphModule(gm, inner))
    with gm.graph.inserting_before(chain[-1]):
        call = gm.graph.call_module(name, tuple(outside))
    call.meta = dict(chain[-1].meta)
    chain[-1].replace_all_uses_with(call)
    for node in reversed(chain):
        gm.graph.erase_node(node)


PASSES = (remove_redundant_casts, fuse_router, fuse_swiglu, fuse_elementwise)


# --------------------------------------------------------------------------------------------- report
@dataclass
class PassResult:
    name: str
    rewrites: int
    nodes_before: int
    nodes_after: int
    launches_before: int
    launches_after: int
    max_abs_diff: float


@dataclass
class FusionReport:
    results: list[PassResult]

    def table(self) -> str:
        lines = [f"{'pass':<24}{'rewrites':>9}{'nodes':>15}{'launches':>15}{'max |diff|':>12}"]
        for r in self.results:
            lines.append(f"{r.name:<24}{r.rewrites:>9}{r.nodes_before:>7} -> {r.nodes_after:<5}"
                         f"{r.launches_before:>7} -> {r.launches_after:<5}{r.max_abs_diff:>12.2e}")
        return "\n".join(lines)


def optimize(gm: fx.GraphModule, inputs: tuple, passes=PASSES, atol: float = 1e-6) -> FusionReport:
    """Run `passes` on gm in place; after each, its outputs on `inputs` must match the unoptimised ones to atol.

    Raises AssertionError naming the pass that broke parity.
    """
    with torch.no_grad():
        expected = gm(*inputs)
    results = []
    for graph_pass in passes:
        nodes, launches = count_nodes(gm), count_launches(gm)
        rewrites = graph_pass(gm)
        with torch.no_grad():
            diff = float((gm(*inputs) - expected).abs().max())
        if not diff <= atol:
            raise AssertionError(f"{graph_pass.__name__}: outputs moved by {diff:.3e} > {atol:.0e}")
        results.append(PassResult(graph_pass.__name__, rewrites, nodes, count_nodes(gm), launches,
                                  count_launches(gm), diff))
    return FusionReport(results)
