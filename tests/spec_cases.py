"""What the speculative-decoding tests share: a tiny model with a one-depth MTP head that echoes its input
(embeddings x5 tied into the LM head, the MTP projection passing the embedding through), so drafts of both
methods are accepted often, as on a trained model."""
import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM


@pytest.fixture(scope="module")
def echo_model():
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None)).eval()
    d = model.config.hidden_size
    with torch.no_grad():
        model.embed_tokens.weight.mul_(5)
        model.lm_head.weight.copy_(model.embed_tokens.weight)
        model.mtp.depths[0].proj.weight[:, d:] = torch.eye(d)
    return model
