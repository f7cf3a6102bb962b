import pytest
import torch

from latentmoe_lab import ModelConfig


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_config() -> ModelConfig:
    return ModelConfig.from_preset("tiny")
