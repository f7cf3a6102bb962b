"""Issue 12 item 10: size guards (full-scale build, empty batch); kda.chunk_size is capped in test_hardening_config."""
import resource

import pytest
import torch
from accelerate import init_empty_weights

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.size_guard import _min_parameters, _parameters_land_on_meta


# three full-scale layers (two MoE layers of 896 experts, ~240 GB in fp32) instead of 93: the same refusal, faster
@pytest.fixture
def full_width():
    return ModelConfig.from_preset("k3-2.8t").replace(num_layers=3)


def test_full_scale_build_is_refused_before_allocating(full_width):
    config = full_width
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(ValueError, match=r"^config: 'k3-2.8t' needs more than [\d,]+\.\d GB of torch.float32 weights.*"
                                         r"nothing was allocated.*torch.device\('meta'\).*from_pretrained"):
        LatentMoEForCausalLM(config)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 512 * 1024, f"peak memory grew by {grown / 1024:.0f} MiB"


def test_building_on_the_meta_device_is_allowed(full_width):
    with torch.device("meta"):
        model = LatentMoEForCausalLM(full_width)
    assert model.lm_head.weight.is_meta
    with init_empty_weights(include_buffers=True):  # meta.py's build
        assert LatentMoEForCausalLM(full_width).lm_head.weight.is_meta
    assert not _parameters_land_on_meta()
    with init_empty_weights():  # parameters made on the CPU, each moved to meta as it is registered
        assert _parameters_land_on_meta()
    assert _min_parameters(full_width) <= sum(p.numel() for p in model.parameters()) > 5e10


def test_the_size_bound_never_exceeds_the_real_count(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    assert 0.5 * sum(p.numel() for p in model.parameters()) < _min_parameters(tiny_config)
    assert _min_parameters(tiny_config) <= sum(p.numel() for p in model.parameters())
    assert _min_parameters(ModelConfig.from_preset("k3-2.8t")) > 0.98 * 2.7805e12  # README's meta count


def test_an_empty_batch_is_a_clear_error(tiny_config):
    model = LatentMoEForCausalLM(tiny_config).eval()
    with pytest.raises(ValueError, match=r"input_ids: expected shape \[B, T\] with B >= 1 and T >= 1, got \(0, 5\)"):
        model(torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="B >= 1"):
        model.generate(torch.zeros(0, 5, dtype=torch.long), max_new_tokens=2)
