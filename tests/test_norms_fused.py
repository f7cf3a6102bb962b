"""rms_norm / l2_norm (one autograd node, backward written out) against their plain-formula twins: outputs and
gradients on ragged shapes, huge, tiny and zero rows, half-precision inputs, and gradcheck in fp64."""
import pytest
import torch

from latentmoe_lab.ops.norms import l2_norm, l2_norm_reference, rms_norm, rms_norm_reference


def _rows(shape, dtype=torch.float64, seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    x.view(-1, shape[-1])[0] *= 1e30  # overflows x^2 in fp32 (and would in fp64 past 1e154: not tested)
    if x.view(-1, shape[-1]).shape[0] > 2:
        x.view(-1, shape[-1])[1] *= 1e-30  # squares underflow
        x.view(-1, shape[-1])[2] = 0.0     # an all-zero row: r = eps^-1/2
    return x


def _forward_backward(norm, x, weight):
    x = x.detach().requires_grad_()
    weight = None if weight is None else weight.detach().requires_grad_()
    out = norm(x, weight) if norm in (rms_norm, rms_norm_reference) else norm(x)
    upstream = torch.linspace(-2, 3, out.numel(), dtype=out.dtype).view_as(out)
    out.backward(upstream)
    return out, x.grad, None if weight is None else weight.grad


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 7, 3, 16), (4, 9, 192)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_norms_equal_their_twins(shape, dtype):
    x = _rows(shape, dtype)
    weight = torch.randn(shape[-1], dtype=dtype, generator=torch.Generator().manual_seed(1))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    cases = [(rms_norm, rms_norm_reference, weight), (rms_norm, rms_norm_reference, None),
             (l2_norm, l2_norm_reference, None)]
    for fused, reference, w in cases:
        got = _forward_backward(fused, x, w)
        want = _forward_backward(reference, x, w)
        for name, a, b in zip(("out", "grad x", "grad weight"), got, want):
            if b is None:
                assert a is None
                continue
            assert torch.isfinite(a).all(), f"{fused.__name__} {name}: not finite"
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{fused.__name__} {name}: {m}")


def test_half_precision_inputs_give_gradients_in_their_own_dtypes():
    x = torch.randn(3, 4, 32).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(32).requires_grad_()
    rms_norm(x, weight).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    x32 = x.detach().float().requires_grad_()
    rms_norm_reference(x32, weight.detach()).sum().backward()
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=2e-2, atol=2e-2)


def test_gradcheck_fp64():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-3), (x, weight))
    assert torch.autograd.gradcheck(lambda a: l2_norm(a, 1e-3), (x,))
