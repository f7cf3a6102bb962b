"""Issue 12 items 2 and 3: non-finite logits are reported where they start; rms_norm does not overflow."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.finite import NonFiniteError, check_finite_logits, first_non_finite
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.ops.norms import l2_norm, rms_norm


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


def test_nan_in_the_lm_head_stops_generate(model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (2, 6))
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")  # after the last router: nothing upstream sees it
    with pytest.raises(NonFiniteError, match=r"2 NaN and 0 inf values in generate prefill; first non-finite at lm_head"):
        model.generate(ids, max_new_tokens=4)


def test_nan_after_the_last_block_names_that_layer(model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 5))
    calls = []

    def poison_second_call(module, args, output):  # the prefill passes, the first decode step does not
        calls.append(1)
        return output * float("nan") if len(calls) == 2 else output

    model.layers[3].register_forward_hook(poison_second_call)
    with pytest.raises(NonFiniteError, match=r"generate step 1; first non-finite at layer 3 \(dsa\)"):
        model.generate(ids, max_new_tokens=4)


def test_forward_records_flags_as_device_tensors(model, tiny_config):
    out = model(torch.randint(0, tiny_config.vocab_size, (1, 3)))
    assert out.finite.dtype == torch.bool and out.finite.shape == (tiny_config.num_layers + 2,)
    assert bool(out.finite.all())
    check_finite_logits(out.logits, out.finite)  # finite: no error


def test_first_non_finite_reads_the_flags():
    layer_types = ["kda", "kda", "kda", "dsa"]
    flags = torch.tensor([True, True, False, False, False, False])
    assert first_non_finite(flags, layer_types) == "layer 1 (kda)"
    assert first_non_finite(torch.tensor([False] * 6), layer_types) == "the embeddings"
    assert first_non_finite(torch.tensor([True] * 5 + [False]), layer_types) == "the final norm"
    assert first_non_finite(None).startswith("unknown")
    with pytest.raises(NonFiniteError, match="0 NaN and 1 inf"):
        check_finite_logits(torch.tensor([[0.0, float("inf")]]))


# ------------------------------------------------------------------------------------------- rms_norm
def _plain_rms_norm(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_survives_huge_rows(dtype):
    x = torch.randn(3, 64)
    weight = torch.rand(64) + 0.5
    expected = _plain_rms_norm(x, weight, 1e-6).to(dtype)
    for magnitude in (1.0, 1e20, 1e30, 1e36):  # x^2 overflows fp32 (and bf16) from 1.8e19
        torch.testing.assert_close(rms_norm((x * magnitude).to(dtype), weight), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(l2_norm((x * 1e30).to(dtype)), l2_norm(x.to(dtype)), atol=2e-2, rtol=2e-2)
    assert rms_norm(torch.zeros(2, 8), None).abs().max() == 0


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 1e15])  # rows with max|x| under 1, around it, far over it
def test_rms_norm_matches_the_plain_formula_and_its_gradient(magnitude):
    x = (torch.randn(5, 7, 48) * torch.logspace(-3, 2, 48) * magnitude).requires_grad_()
    weight = (torch.rand(48) + 0.5).requires_grad_()
    grad_out = torch.randn(5, 7, 48)
    ours = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(ours, _plain_rms_norm(x, weight, 1e-6))
    got = torch.autograd.grad(ours, (x, weight), grad_out)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    x64_ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64  # autograd through the formula
    want = torch.autograd.grad(x64_ref, (x64, w64), grad_out.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)


def test_huge_embeddings_no_longer_give_zero_logits(model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 6))
    assert isinstance(model.norm, RMSNorm)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(1e30 / model.embed_tokens.weight.abs().max())
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.abs().max() > 1e-3
