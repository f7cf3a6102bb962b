"""`serve --checkpoint DIR` on what `latentmoe-lab quantize` writes (server/loading.py).

It used to be refused ("leave dtype unset", which no service file can do: model.dtype defaults to fp32).
Now the quantized model serves as saved, and the engine's greedy tokens equal the quantized model's own
generate(); a model.dtype that differs from the unquantized weights' is refused naming the key.
"""
import dataclasses

import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.quant import get_recipe, quantize_model, save_quantized
from latentmoe_lab.server.loading import load_model, resolve_service, with_checkpoint
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

SERVICE = {"model": {"preset": "tiny", "max_model_len": 256},
           "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000}}
PROMPTS = [[105, 109, 112, 111, 114, 116, 32], list(range(40, 75))]


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    quantize_model(model, get_recipe("fp8-experts"))
    return save_quantized(model, tmp_path_factory.mktemp("quantized") / "tiny-fp8")


def test_a_quantized_checkpoint_serves_as_saved(quantized_dir):
    config = with_checkpoint(ServiceConfig.from_dict(SERVICE), str(quantized_dir))
    model = load_model(config)  # model.dtype fp32, the default
    assert model.quant_recipe.name == "fp8-experts"
    outputs = Engine(model, config).generate(PROMPTS, SamplingParams(max_tokens=6), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6)[0, len(prompt):].tolist()
        assert output.token_ids == expected


def test_a_dtype_other_than_the_saved_one_is_refused_naming_the_key(quantized_dir):
    config = with_checkpoint(ServiceConfig.from_dict(SERVICE), str(quantized_dir))
    bf16 = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bf16"))
    with pytest.raises(ValueError, match=r"^model\.dtype: .* unquantized weights are fp32; set model\.dtype: fp32"):
        load_model(bf16)


def test_the_shipped_cpu_file_serves_a_quantized_checkpoint_in_process(quantized_dir, tmp_path, capsys):
    """configs/service-cpu.yaml puts the forward in a worker process, which reloads plain weights only: the
    quantized model runs in the server process instead (it used to fail in the worker with a traceback)."""
    config, _ = resolve_service("configs/service-cpu.yaml", str(quantized_dir))
    assert config.model.checkpoint == str(quantized_dir) and not config.parallel.forward_process
    assert "is quantized: the forward runs in the server process" in capsys.readouterr().err
    ep2 = tmp_path / "ep2.yaml"
    ep2.write_text("model: {preset: tiny, max_model_len: 256}\nparallel: {expert_parallel_size: 2}\n"
                   "memory: {max_num_seqs: 4, block_size: 16, cache_bytes: 2000000}\n")
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel_size: .* is a quantized checkpoint"):
        resolve_service(str(ep2), str(quantized_dir))
