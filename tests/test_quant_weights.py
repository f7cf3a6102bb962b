"""Packed weight formats (fp8 block, int8 channel, mxfp4) and the modules that hold them (docs/design.md §7)."""
import pytest
import torch

from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.quant import QuantLatentExperts, QuantLinear, experts as experts_module
from latentmoe_lab.quant.activations import ActivationQuantizer
from latentmoe_lab.quant.linear import WEIGHT_FORMATS
from latentmoe_lab.quant.weight_mxfp4 import E2M1_MAGNITUDES, e2m1_decode, e2m1_encode, e8m0_decode

RAGGED = [(200, 300), (3, 130, 129), (1, 1), (128, 256)]


@pytest.mark.parametrize("shape", RAGGED)
def test_fp8_block_round_trip_within_e4m3_precision(shape):
    fmt = WEIGHT_FORMATS["fp8"]
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])  # channels spanning four decades
    packed = fmt.pack(w)
    rows, cols = shape[-2:]
    assert packed["data"].dtype == torch.uint8 and packed["data"].shape == w.shape
    assert packed["scale"].shape == (*shape[:-2], -(-rows // 128), -(-cols // 128))
    scale = fmt._expand(packed["scale"], rows, cols)
    scaled, err = w / scale, (fmt.unpack(packed) - w).abs()
    normal = scaled.abs() >= 2 ** -6  # e4m3 normals: 3 mantissa bits -> half-ulp relative error 2^-4
    assert bool((err[normal] <= 2 ** -4 * w.abs()[normal]).all())
    assert bool((err[~normal] <= 2 ** -10 * scale[~normal] + 1e-30).all())  # subnormal spacing 2^-9
    assert float(scaled.abs().amax()) == pytest.approx(448.0)  # each block's absmax maps onto e4m3's max


@pytest.mark.parametrize("shape", RAGGED)
def test_int8_channel_error_at_most_half_a_scale(shape):
    fmt = WEIGHT_FORMATS["int8"]
    w = torch.randn(shape) * torch.logspace(-2, 1, shape[-2])[:, None]
    packed = fmt.pack(w)
    assert packed["data"].dtype == torch.int8 and packed["scale"].shape == shape[:-1]
    err = (fmt.unpack(packed) - w).abs()
    assert bool((err <= packed["scale"][..., None] / 2 * (1 + 1e-6)).all())


def _nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Brute force: the E2M1 magnitude nearest |v| (ties to the even code), with v's sign; saturates at 6."""
    mags = torch.tensor(E2M1_MAGNITUDES)
    dist = (v.abs().clamp(max=6)[..., None] - mags).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = torch.where(dist == best, torch.arange(8), 99)
    even_first = torch.where(candidates % 2 == 0, candidates, candidates + 100).min(dim=-1).values % 100
    return torch.where(v < 0, -mags[even_first], mags[even_first])


def test_e2m1_encoding_matches_brute_force_nearest_even():
    v = torch.cat([torch.linspace(-7, 7, 2801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 9.0])])
    assert torch.equal(e2m1_decode(e2m1_encode(v)), _nearest_e2m1(v))
    assert e2m1_encode(torch.tensor([0.75])).item() == 2 and e2m1_encode(torch.tensor([1.25])).item() == 2


def test_mxfp4_layout_nibbles_and_e8m0():
    fmt = WEIGHT_FORMATS["mxfp4"]
    w = torch.zeros(1, 40)  # a ragged second block of 8
    w[0, :4] = torch.tensor([0.5, 1.0, -6.0, 3.0])  # absmax 6 -> X = 2^(2 - 2) = 1
    w[0, 32] = 0.75  # second block: absmax 0.75 -> X = 2^(-1 - 2)
    packed = fmt.pack(w)
    assert packed["data"].shape == (1, 32) and packed["scale"].shape == (1, 2)
    assert packed["data"][0, 0].item() == 0x21  # element 0 (code 1) low nibble, element 1 (code 2) high nibble
    assert packed["data"][0, 1].item() == (0x8 | 7) | (5 << 4)  # -6: sign + code 7; 3.0: code 5
    assert packed["scale"].tolist() == [[127, 124]]
    assert e8m0_decode(packed["scale"]).tolist() == [[1.0, 0.125]]
    assert torch.equal(fmt.unpack(packed)[:, :40], w)  # every value here is exactly representable


@pytest.mark.parametrize("shape", [(70, 100), (2, 33, 31)])
def test_mxfp4_round_trip_is_the_nearest_point_of_the_block_grid(shape):
    fmt = WEIGHT_FORMATS["mxfp4"]
    w = torch.randn(shape)
    packed = fmt.pack(w)
    blocks = -(-shape[-1] // 32)
    scale = e8m0_decode(packed["scale"]).repeat_interleave(32, dim=-1)[..., :shape[-1]]
    assert packed["scale"].shape == (*shape[:-1], blocks)
    assert torch.equal(fmt.unpack(packed)[..., :shape[-1]], _nearest_e2m1(w / scale) * scale)


def _linear(in_features, out_features):
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05)
    return linear


@pytest.mark.parametrize("fmt", ["fp8", "int8", "mxfp4"])
@pytest.mark.parametrize("act", [None, "int8", "fp8"])
def test_quant_linear_tiles_equal_the_dequantize_then_matmul_twin(fmt, act):
    linear = _linear(130, 600)  # 600 output rows: two tiles of 512, a ragged fp8 block and mxfp4 block
    quantizer = None if act is None else ActivationQuantizer("dynamic", act, 130)
    module = QuantLinear.from_linear(linear, fmt, quantizer)
    for x in (torch.randn(3, 5, 130), torch.randn(1, 130), torch.randn(0, 130)):
        out = module(x)
        assert out.shape == (*x.shape[:-1], 600)
        torch.testing.assert_close(out, module.reference_forward(x), rtol=1e-5, atol=1e-6)
    x = torch.randn(4, 130)
    linear.requires_grad_(False)
    close = {"fp8": 0.1, "int8": 0.02, "mxfp4": 0.3}[fmt] + (0.05 if act else 0)
    rel = (module(x) - linear(x)).norm() / linear(x).norm()
    assert float(rel) < close
    assert module.weight.shape == linear.weight.shape and module.weight.dtype == linear.weight.dtype


def test_quant_linear_keeps_scales_fp32_under_model_to_bf16():
    module = QuantLinear.from_linear(_linear(64, 64), "fp8", ActivationQuantizer("static", "int8", 64))
    scale = module.weight_scale.clone()
    module.to(torch.bfloat16)
    assert module.weight_scale.dtype == torch.float32 and torch.equal(module.weight_scale, scale)
    assert module.weight.dtype == torch.bfloat16 and module.activation.scale.dtype == torch.float32
    with pytest.raises(ValueError, match="not calibrated"):
        module(torch.randn(2, 64, dtype=torch.bfloat16))
    module.activation.scale.fill_(0.01)
    assert module(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="x: expected last dim 64"):
        module(torch.randn(2, 63))


def _experts(num_experts, latent, inter, clamp=None):
    experts = LatentExperts(num_experts, latent, inter, clamp)
    torch.nn.init.normal_(experts.w13, std=0.1)
    torch.nn.init.normal_(experts.w2, std=0.1)
    return experts


@pytest.mark.parametrize("fmt", ["fp8", "int8", "mxfp4"])
def test_quant_experts_equal_their_twins_with_empty_experts_and_ragged_dims(fmt, monkeypatch):
    experts = _experts(6, 40, 24, clamp=2.0)  # 40 = one mxfp4 block + 8, not a multiple of 128 either
    act = ActivationQuantizer("dynamic", "int8", 40), ActivationQuantizer("dynamic", "int8", 24)
    for acts in ((None, None), act):
        quant = QuantLatentExperts.from_experts(experts, fmt, *acts)
        counts = torch.tensor([3, 0, 1, 0, 7, 0])  # empty experts in the middle and at the end
        z = torch.randn(int(counts.sum()), 40)
        ref = quant.reference_forward(z, counts)
        torch.testing.assert_close(quant(z, counts), ref, rtol=1e-5, atol=1e-6)
        monkeypatch.setattr(experts_module, "TILE_BYTES", 1)  # one expert per tile
        torch.testing.assert_close(quant(z, counts), ref, rtol=1e-5, atol=1e-6)
        monkeypatch.undo()
        assert quant(z[:0], torch.zeros(6, dtype=torch.long)).shape == (0, 40)
        one = torch.tensor([0, 0, 1, 0, 0, 0])
        torch.testing.assert_close(quant(z[:1], one)[0], quant.expert_reference(z[0], 2), rtol=1e-5, atol=1e-6)
    # Weight-only: the packed experts are the plain experts holding the dequantized weights.
    quant = QuantLatentExperts.from_experts(experts, fmt)
    plain = LatentExperts(6, 40, 24, 2.0)
    with torch.no_grad():
        plain.w13.copy_(quant._weights("w13"))
        plain.w2.copy_(quant._weights("w2"))
    torch.testing.assert_close(quant(z, counts), plain(z, counts), rtol=1e-5, atol=1e-6)


def test_quant_experts_never_dequantize_an_expert_without_rows(monkeypatch):
    quant = QuantLatentExperts.from_experts(_experts(5, 32, 16), "mxfp4")
    seen = []
    original = quant._weights
    monkeypatch.setattr(quant, "_weights", lambda name, ids=None: seen.append(ids.tolist()) or original(name, ids))
    quant(torch.randn(4, 32), torch.tensor([0, 3, 0, 1, 0]))
    assert seen == [[1, 3], [1, 3]]
