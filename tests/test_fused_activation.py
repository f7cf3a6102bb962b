"""The fused GLU activations (ops/fused_glu.py) against their plain twin, autograd through ops.routing.expert_glu:
the output and both inputs' gradients, on ragged shapes, with SiTU at K3's betas (4, 25) on pre-activations large
enough to saturate both tanh factors, and SwiGLU with its clamp cutting some entries."""
import pytest
import torch

from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.ops.batch_invariant import batch_invariant_mode
from latentmoe_lab.ops.fused_glu import FusedGLU, fused_glu, glu_backward
from latentmoe_lab.ops.routing import expert_glu

K3_BETAS = (4.0, 25.0)
# (clamp, situ_betas)
FORMS = {"swiglu": (None, None), "swiglu_clamp": (3.0, None), "situ": (None, K3_BETAS), "situ_small": (None, (0.5, 2.0))}
SHAPES = [(7,), (3, 13), (2, 5, 9), (0, 4)]


def make_pre(shape, dtype=torch.float64, seed: int = 0):
    """gate ~ N(0, 30^2) and up ~ N(0, 60^2): far past b1 = 4 and b2 = 25 (saturation) and past the clamp,
    with a near-zero band. Entries within 1e-3 of a clamp bound are moved off it (a kink gradcheck cannot
    difference)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 3.0, 30.0], dtype=dtype)[torch.randint(0, 3, shape, generator=gen)]
    gate = torch.randn(shape, generator=gen, dtype=dtype) * scale
    up = torch.randn(shape, generator=gen, dtype=dtype) * scale * 2
    for t in (gate, up):
        near = ((t.abs() - 3.0).abs() < 1e-3)
        t[near] += 0.01
    return gate.requires_grad_(), up.requires_grad_()


def grads(op, gate, up, weight):
    out = op(gate, up)
    return out.detach(), torch.autograd.grad((out * weight).sum(), (gate, up))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
def test_fused_matches_autograd_through_the_twin(form, shape, dtype, rtol):
    clamp, situ_betas = FORMS[form]
    gate, up = make_pre(shape, dtype)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    out, (grad_gate, grad_up) = grads(lambda g, u: fused_glu(g, u, clamp, situ_betas), gate, up, weight)
    twin_out, (twin_gate, twin_up) = grads(lambda g, u: expert_glu(g, u, clamp, situ_betas), gate, up, weight)
    assert torch.equal(out, twin_out)  # the forward keeps the twin's bits
    for actual, expected in ((grad_gate, twin_gate), (grad_up, twin_up)):
        assert torch.isfinite(actual).all()
        assert torch.allclose(actual, expected, rtol=rtol, atol=rtol * max(expected.abs().amax().item(), 1.0)
                              if expected.numel() else 0.0)


@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_in_fp64(form):
    clamp, situ_betas = FORMS[form]
    gate, up = make_pre((4, 6))
    assert torch.autograd.gradcheck(lambda g, u: FusedGLU.apply(g, u, clamp, situ_betas), (gate, up))


@pytest.mark.parametrize("form", FORMS)
def test_glu_backward_writes_both_halves_of_one_buffer_and_returns_act(form):
    """The routed experts' use: gate | up halves of one [r, 2F] pre-activation and one [r, 2F] gradient."""
    clamp, situ_betas = FORMS[form]
    rows, inter = 11, 6
    gate, up = make_pre((rows, inter), torch.float32)
    pre = torch.cat([gate.detach(), up.detach()], dim=1)
    grad_act = torch.randn(rows, inter, generator=torch.Generator().manual_seed(2))
    grad_pre = torch.full((rows, 2 * inter), float("nan"))
    # (the gate half contiguous, as ops/routed_experts.py passes it: torch's CPU silu can round a strided
    # element an ulp apart from a contiguous one)
    act = glu_backward(pre[:, :inter].contiguous(), pre[:, inter:], grad_act, grad_pre[:, :inter],
                       grad_pre[:, inter:], clamp, situ_betas)
    twin_out, (twin_gate, twin_up) = grads(lambda g, u: expert_glu(g, u, clamp, situ_betas), gate, up, grad_act)
    assert torch.equal(act, twin_out)
    assert torch.allclose(grad_pre, torch.cat([twin_gate, twin_up], dim=1), rtol=1e-6, atol=1e-5)


def test_without_gradients_and_in_batch_invariant_mode_it_is_the_twin():
    gate, up = make_pre((5, 8), torch.float32)
    with torch.no_grad():
        assert torch.equal(fused_glu(gate, up, None, K3_BETAS), expert_glu(gate, up, None, K3_BETAS))
    with batch_invariant_mode():
        out = fused_glu(gate, up)
        assert out.grad_fn is not None and type(out.grad_fn).__name__ != "FusedGLUBackward"
        assert torch.equal(out, expert_glu(gate, up))


@pytest.mark.parametrize("clamp, situ_betas, message", [
    (1.0, K3_BETAS, "clamp: must be None with situ_betas"),
    (None, (0.0, 25.0), "beta_gate: must be a finite number > 0"),
    (None, (4.0, float("inf")), "beta_up: must be a finite number > 0"),
])
def test_bad_arguments_are_refused_as_by_the_twin(clamp, situ_betas, message):
    gate, up = make_pre((2, 3))
    with pytest.raises(ValueError, match=message):
        fused_glu(gate, up, clamp, situ_betas)


@pytest.mark.parametrize("situ_betas", [None, K3_BETAS])
def test_ffn_module_gradients_match_the_twin_formula(situ_betas):
    """layers/ffn.py's SwiGLU (dense FFN, shared experts) through the fused node vs the same weights by hand."""
    torch.manual_seed(0)
    ffn = SwiGLU(12, 20, situ_betas=situ_betas).double()
    x = (torch.randn(3, 7, 12, dtype=torch.float64) * 10).requires_grad_()
    params = [x, ffn.w1.weight, ffn.w3.weight, ffn.w2.weight]
    out = ffn(x)
    twin = expert_glu(x @ ffn.w1.weight.t(), x @ ffn.w3.weight.t(), None, situ_betas) @ ffn.w2.weight.t()
    weight = torch.randn(out.shape, dtype=torch.float64)
    for actual, expected in zip(torch.autograd.grad((out * weight).sum(), params),
                                torch.autograd.grad((twin * weight).sum(), params)):
        assert torch.allclose(actual, expected, rtol=1e-12, atol=1e-12)
