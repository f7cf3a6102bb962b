"""Expert caching from recorded traffic (parallel/offload.py + parallel/eplb/load.py): the recorder's hot
experts stay resident, and on the same traffic that reads fewer bytes from disk than the default policy."""
import copy

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder
from latentmoe_lab.parallel.offload import offload_experts, offload_stats


@torch.no_grad()
def test_recorded_frequencies_keep_the_hot_experts_resident(tiny_config, tmp_path):
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(tiny_config).eval()
    for layer in model.modules():
        if isinstance(layer, LatentMoE):
            layer.correction_bias[5:] = 10.0  # skewed traffic: experts 5, 6, 7 win every selection they can
    batches = [torch.randint(0, tiny_config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(s))
               for s in range(4)]
    recorder = ExpertLoadRecorder.for_model(model, window_steps=4)
    hook = recorder.attach(model)
    expected = [model(ids).logits for ids in batches]  # the served traffic, recorded
    hook.remove()
    default, recorded = copy.deepcopy(model), copy.deepcopy(model)
    results = {}
    for name, copy_, kwargs in (("default", default, {}), ("recorded", recorded, {"frequencies": recorder.window})):
        layers = offload_experts(copy_, tmp_path, hot=3, capacity=1, policy="lfu", **kwargs)
        for ids, logits in zip(batches, expected):
            torch.testing.assert_close(copy_(ids).logits, logits)  # residency never changes the math
        results[name] = offload_stats(layers, len(batches))
    assert all(set(m.hot) == {5, 6, 7} for m in layers.values())
    assert results["recorded"]["hit_rate"] > results["default"]["hit_rate"]
    assert results["recorded"]["bytes_per_step"] < results["default"]["bytes_per_step"]
    with pytest.raises(ValueError, match="^frequencies:"):
        offload_experts(copy.deepcopy(model), tmp_path, hot=3, capacity=1, frequencies=recorder.window[:1])

