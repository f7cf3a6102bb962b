"""torch.ops.latentmoe custom ops (latentmoe_lab.porting.custom_ops): opcheck, one node in torch.export and in
torch.compile, gradients equal to the reference twins', and the model unchanged through use_custom_ops."""
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab.ops import kda_chunked, route_topk, sparse_attention
from latentmoe_lab.ops.routing import grouped_matmul, swiglu
from latentmoe_lab.porting.custom_ops import OPS, TRAINING_OPS
from latentmoe_lab.porting.swap import use_custom_ops


def _kda_inputs(grad=False):
    g = torch.Generator().manual_seed(0)
    shape = (1, 5, 2, 4)  # T = 5: one full chunk of 4 and a ragged one
    q, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k = F.normalize(torch.randn(shape, generator=g), dim=-1)
    decay = -torch.rand(shape, generator=g)
    decay[0, 2] = -1000.0  # a reset
    beta = torch.rand(1, 5, 2, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v, decay, beta)]


def _cases():
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([2, 2, 4, 6, 6, 10, 12, 14])  # experts 1 and 4 get no token
    return {
        "route_topk": (torch.randn(7, 8, generator=g, requires_grad=True), torch.randn(8, generator=g) * 0.1, 2, 2, 1,
                       1.0),
        "route_gate": (torch.randn(7, 16, generator=g, requires_grad=True), torch.randn(8, 16, generator=g), None, 2,
                       1, 1, 2.5),
        "dispatch_plan": (torch.randint(0, 8, (7, 2), generator=g), 8),
        "grouped_matmul": (torch.randn(14, 16, generator=g, requires_grad=True),
                           torch.randn(8, 16, 8, generator=g, requires_grad=True), offsets),
        "grouped_swiglu": (torch.randn(14, 16, generator=g, requires_grad=True),
                           torch.randn(8, 16, 16, generator=g, requires_grad=True), offsets, 3.0),
        "kda_chunk": (*_kda_inputs(grad=True), None, 0.5, 4),
        "kda_decode_step": (torch.randn(1, 2, 4, 4, generator=g), *(t[:, 0] for t in _kda_inputs()), 0.5),
        "index_topk": (torch.randn(1, 5, 2, 4, generator=g), torch.randn(1, 5, 4, generator=g),
                       torch.randn(1, 5, 2, generator=g), 3, 0),
        "sparse_attention": (torch.randn(1, 5, 2, 4, generator=g, requires_grad=True),
                             torch.randn(1, 5, 1, 4, generator=g, requires_grad=True),
                             torch.randn(1, 5, 1, 4, generator=g, requires_grad=True),
                             torch.tensor([[[0, -1, -1], [0, 1, -1], [2, 1, 0], [3, 2, 1], [4, 0, 1]]]), 0.5),
    }


@pytest.mark.parametrize("name", sorted(OPS))
def test_opcheck(name):
    """torch's own checks of a custom op: schema, autograd registration, fake kernel, AOT dispatch."""
    results = torch.library.opcheck(OPS[name], _cases()[name])
    assert set(results) == {"test_schema", "test_autograd_registration", "test_faketensor",
                            "test_aot_dispatch_dynamic"} and set(results.values()) == {"SUCCESS"}, results


class _Call(torch.nn.Module):
    """One call of op `name`: the case's tensors are the forward's inputs, its other arguments fixed."""

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.template = [None if isinstance(a, torch.Tensor) else a for a in _cases()[name]]
        self.positions = [i for i, a in enumerate(_cases()[name]) if isinstance(a, torch.Tensor)]

    def forward(self, *tensors):
        args = list(self.template)
        for i, tensor in zip(self.positions, tensors):
            args[i] = tensor
        return OPS[self.name](*args)


def _compute_nodes(graph):
    return [n for n in graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]


@pytest.mark.parametrize("name", ["kda_chunk", "sparse_attention", "grouped_swiglu", "route_topk"])
def test_export_and_compile_see_one_node(name):
    tensors = tuple(a.detach() for a in _cases()[name] if isinstance(a, torch.Tensor))
    exported = torch.export.export(_Call(name), tensors)
    nodes = _compute_nodes(exported.graph)
    assert [str(n.target) for n in nodes] == [f"latentmoe.{name}.default"]
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Call(name), backend=backend, fullgraph=True)(*tensors)
    targets = [str(n.target) for n in _compute_nodes(seen[0].graph)]
    assert len(seen) == 1 and targets in ([f"latentmoe.{name}"], [f"latentmoe.{name}.default"])


def _grads(outputs, inputs):
    total = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outputs)
    return torch.autograd.grad(total, inputs)


def test_gradients_equal_the_reference_twins():
    cases = _cases()
    logits, bias = cases["route_topk"][0], cases["route_topk"][1]
    for got, want in zip(_grads([OPS["route_topk"](logits, bias, 2, 2, 1, 1.0)[0]], [logits]),
                         _grads([route_topk(logits, 2, bias, 2, 1)[0]], [logits])):
        torch.testing.assert_close(got, want)
    x, w13, offsets, clamp = cases["grouped_swiglu"]
    reference = swiglu(*grouped_matmul(x, w13, offsets, impl="padded").chunk(2, dim=-1), clamp)
    for got, want in zip(_grads([OPS["grouped_swiglu"](x, w13, offsets, clamp)], [x, w13]),
                         _grads([reference], [x, w13])):
        torch.testing.assert_close(got, want)
    q, k, v, g, beta = _kda_inputs(grad=True)
    for got, want in zip(_grads(OPS["kda_chunk"](q, k, v, g, beta, None, 0.5, 4), [q, k, v, g, beta]),
                         _grads(kda_chunked(q, k, v, g, beta, 0.5, None, True, 4), [q, k, v, g, beta])):
        torch.testing.assert_close(got, want)
        assert got.isfinite().all()  # the g = -1000 reset stays finite
    sq, sk, sv, indices, scale = cases["sparse_attention"]
    for got, want in zip(_grads([OPS["sparse_attention"](sq, sk, sv, indices, scale)], [sq, sk, sv]),
                         _grads([sparse_attention(sq, sk, sv, indices, scale)], [sq, sk, sv])):
        torch.testing.assert_close(got, want)
    assert set(TRAINING_OPS) <= set(OPS)
    with pytest.raises(ValueError, match="initial_state: latentmoe.kda_chunk gives it no gradient"):
        OPS["kda_chunk"](q, k, v, g, beta, torch.zeros(1, 2, 4, 4, requires_grad=True), 0.5, 4)


def test_use_custom_ops_leaves_generate_and_training_unchanged(model):
    ids = torch.randint(0, 200, (2, 21), generator=torch.Generator().manual_seed(2))
    expected = model.generate(ids, max_new_tokens=4)  # prefill through kda_chunk, decode through kda_decode_step
    with use_custom_ops():
        assert torch.equal(model.generate(ids, max_new_tokens=4), expected)
    plain = model(ids, labels=ids).loss
    plain_grads = torch.autograd.grad(plain, list(model.parameters()), allow_unused=True)
    with use_custom_ops():
        swapped = model(ids, labels=ids).loss
        swapped_grads = torch.autograd.grad(swapped, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(swapped, plain)
    for got, want in zip(swapped_grads, plain_grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
