"""LatentMoE Lab: a readable reproduction of a 2.8T-parameter hybrid-attention sparse MoE.

    from latentmoe_lab import ModelConfig, LatentMoEForCausalLM
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
"""
from latentmoe_lab.config import ModelConfig

__all__ = ["ModelConfig", "LatentMoEForCausalLM"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The model pulls in every layer; importing it lazily keeps `import latentmoe_lab` light.
    if name == "LatentMoEForCausalLM":
        from latentmoe_lab.model import LatentMoEForCausalLM

        return LatentMoEForCausalLM
    raise AttributeError(f"module 'latentmoe_lab' has no attribute {name!r}")
