import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM

# Test shapes are tiny: a second OpenMP thread brings no speed, and on a busy 2-core machine every
# parallel region waits for a descheduled thread (100x slowdowns were seen in kda_chunked).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_config() -> ModelConfig:
    return ModelConfig.from_preset("tiny")


@pytest.fixture(scope="module")
def model() -> LatentMoEForCausalLM:
    """The tiny preset with seed-0 random weights, in eval mode. Module-scoped: each test module builds its
    own, so a module may change it (paged_decode modes, hooks) without reaching another's."""
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
