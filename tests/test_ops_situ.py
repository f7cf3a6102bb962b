"""ops.activations.situ (K3's expert activation): the formula, its hand-written derivative, the betas' checks."""
import math

import pytest
import torch

from latentmoe_lab.ops.activations import situ, situ_grads
from latentmoe_lab.ops.routing import expert_glu


def situ_formula(g: float, u: float, b1: float, b2: float) -> float:
    """One element in python floats, straight from the definition."""
    return b1 * math.tanh(g / b1) / (1 + math.exp(-g)) * b2 * math.tanh(u / b2)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 11)])
def test_situ_equals_the_formula_and_autograd_equals_the_derivative(shape):
    g = torch.randn(shape, dtype=torch.float64) * 6  # well into tanh's saturation for b1 = 4
    u = torch.randn(shape, dtype=torch.float64) * 40
    g.requires_grad_(True)
    u.requires_grad_(True)
    out = situ(g, u, 4.0, 25.0)
    want = torch.tensor([situ_formula(a, b, 4.0, 25.0) for a, b in zip(g.flatten().tolist(), u.flatten().tolist())],
                        dtype=torch.float64).reshape(shape)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn(shape, dtype=torch.float64)
    grad_g, grad_u = torch.autograd.grad((out * grad_out).sum(), (g, u))
    a, da, b, db = situ_grads(g.detach(), u.detach(), 4.0, 25.0)
    torch.testing.assert_close(grad_g, grad_out * da * b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_u, grad_out * a * db, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, y: situ(x, y, 3.0, 7.0), (g[..., :2], u[..., :2]))


def test_situ_is_silu_times_up_for_small_inputs_and_bounded_for_large():
    g = torch.linspace(-0.01, 0.01, 9, dtype=torch.float64)
    u = torch.linspace(-0.02, 0.03, 9, dtype=torch.float64)
    torch.testing.assert_close(situ(g, u), torch.nn.functional.silu(g) * u, rtol=1e-4, atol=1e-9)
    big = situ(torch.full((3,), 1e4, dtype=torch.float64), torch.full((3,), 1e4, dtype=torch.float64))
    torch.testing.assert_close(big, torch.full((3,), 100.0, dtype=torch.float64))  # b1 * b2


def test_expert_glu_picks_the_activation_and_refuses_a_clamp_with_situ():
    g, u = torch.randn(4, 6), torch.randn(4, 6)
    torch.testing.assert_close(expert_glu(g, u), torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(expert_glu(g, u, situ_betas=(4.0, 25.0)), situ(g, u, 4.0, 25.0))
    with pytest.raises(ValueError, match="clamp"):
        expert_glu(g, u, 7.0, (4.0, 25.0))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "4"])
def test_bad_betas_are_refused_by_name(bad):
    g = torch.randn(3)
    with pytest.raises(ValueError, match="beta_gate"):
        situ(g, g, bad, 25.0)
    with pytest.raises(ValueError, match="beta_up"):
        situ(g, g, 4.0, bad)
    with pytest.raises(ValueError, match="gate, up"):
        situ(g, torch.randn(4))
