"""W8A8 activation simulation (docs/design.md §7): dynamic 1 x 128 groups, static calibrated scales, SmoothQuant."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.quant import QuantLinear, calibrate, quantize_model
from latentmoe_lab.quant.activations import ActivationQuantizer, fake_quantize, quantize_groups
from latentmoe_lab.quant.calibration import ActivationStats, channel_absmax
from latentmoe_lab.quant.quantize import smoothing_factors


@pytest.mark.parametrize("width", [128, 200, 16])
def test_dynamic_groups_bound_the_error_per_token_and_group(width):
    x = torch.randn(7, width) * torch.logspace(-2, 1, 7)[:, None]
    x[:, -1] *= 40  # an outlier in the last (ragged) group only
    groups = -(-width // 128)
    padded = torch.nn.functional.pad(x, (0, groups * 128 - width)).view(7, groups, 128)
    scale = (padded.abs().amax(-1) / 127).repeat_interleave(128, -1)[:, :width]  # ceil(I / 128) groups
    assert bool(((quantize_groups(x, "int8") - x).abs() <= scale / 2 * (1 + 1e-6)).all())
    fp8 = quantize_groups(x, "fp8")
    assert bool(((fp8 - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * scale * 127 / 448).all())
    if width > 128:  # the outlier's group does not coarsen the first group
        first = x[:, :128]
        assert bool(((quantize_groups(x, "int8")[:, :128] - first).abs()
                     <= first.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)).all())


def test_calibration_methods_on_a_heavy_tailed_distribution():
    g = torch.Generator().manual_seed(0)
    stats = ActivationStats()
    for _ in range(4):
        x = torch.randn(256, 64, generator=g)
        x[0, 0] = 60.0  # rare outliers set the absmax
        stats.observe(x)
    values = torch.cat(stats.samples)
    absmax, pct, mse = (stats.clip(m, "int8", 99.9) for m in ("absmax", "percentile", "mse"))
    assert absmax == 60.0 and pct < 5 and mse < absmax
    assert pct == pytest.approx(float(torch.quantile(values.abs(), 0.999)))

    def error(clip):
        return float((fake_quantize(values, torch.tensor(clip / 127), "int8") - values).pow(2).mean())
    assert error(mse) <= error(absmax) and error(mse) <= error(absmax / 2)
    with pytest.raises(ValueError, match="method: must be one of"):
        stats.clip("entropy", "int8")


@pytest.mark.parametrize("method", ["absmax", "percentile", "mse"])
def test_calibrate_sets_every_static_scale_of_a_model(method, tiny_config):
    batches = [torch.randint(0, tiny_config.vocab_size, (2, 24)) for _ in range(2)]
    model = quantize_model(LatentMoEForCausalLM(tiny_config).eval(), "int8-w8a8-static", progress=False)
    with pytest.raises(ValueError, match="not calibrated"):
        model(batches[0])
    scales = calibrate(model, batches, method, progress=False)
    quantizers = {n: m for n, m in model.named_modules() if isinstance(m, ActivationQuantizer)}
    assert set(scales) == set(quantizers) and not any(".wkv_b." in n for n in quantizers)  # wkv_b: weight-only
    assert all(float(quantizers[n].scale) == pytest.approx(s) and s > 0 for n, s in scales.items())
    assert torch.isfinite(model(batches[0]).logits).all()
    with pytest.raises(ValueError, match="no static activation quantizer"):
        calibrate(LatentMoEForCausalLM(tiny_config), batches, method)


def test_smoothquant_moves_an_outlier_channel_into_the_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, bias=False)
    channel_scale = torch.ones(256)
    channel_scale[[5, 77]] = 60.0  # two outlier input channels, as LLM activations have
    batches = [torch.randn(32, 256) * channel_scale for _ in range(4)]
    x = torch.randn(64, 256) * channel_scale
    reference = linear(x).detach()

    def static_error(smooth):
        act = ActivationQuantizer("static", "int8", 256, smooth=smooth is not None)
        if smooth is not None:
            act.smooth.copy_(smooth)
        module = QuantLinear.from_linear(linear, "int8", act)
        calibrate(torch.nn.Sequential(module), batches, "absmax", progress=False)
        return float((module(x) - reference).norm() / reference.norm())

    maxima = channel_absmax(torch.nn.Sequential(linear), {"0": linear}, batches, progress=False)["0"]
    plain, smoothed = static_error(None), static_error(smoothing_factors(linear, maxima, 0.5))
    assert smoothed < plain / 2, (plain, smoothed)
