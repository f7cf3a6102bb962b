"""Issue 12 item 6: models offloaded into one folder keep their own weights; files are verified on load."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.parallel.offload import dispatch_with_offload, offload_experts


def _model(tiny_config, seed):
    torch.manual_seed(seed)
    return LatentMoEForCausalLM(tiny_config).eval()


@torch.no_grad()
def test_two_models_in_one_expert_folder_keep_their_own_experts(tiny_config, tmp_path):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 16))
    first, second = _model(tiny_config, 1), _model(tiny_config, 2)
    expected_first, expected_second = first(ids).logits, second(ids).logits
    offloaded_first = offload_experts(first, tmp_path, hot=0, capacity=2)  # every expert cold, read from disk
    offload_experts(second, tmp_path, hot=0, capacity=2)  # the same folder
    torch.testing.assert_close(first(ids).logits, expected_first)
    torch.testing.assert_close(second(ids).logits, expected_second)
    folders = {experts.folder.parent for experts in offloaded_first.values()}
    assert len(folders) == 1 and folders.pop().parent == tmp_path
    assert len(list(tmp_path.glob("model-*"))) == 2


@torch.no_grad()
def test_a_replaced_expert_file_is_refused(tiny_config, tmp_path):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 16))
    model = _model(tiny_config, 1)
    layers = offload_experts(model, tmp_path, hot=0, capacity=1)
    target = layers[1].folder
    swapped = torch.load(target / "expert_0.pt", weights_only=True)
    torch.save({"w13": swapped["w13"] + 1, "w2": swapped["w2"]}, target / "expert_0.pt")  # same shapes
    torch.save({"w13": swapped["w13"][:1], "w2": swapped["w2"]}, target / "expert_1.pt")  # another shape
    with pytest.raises(ValueError, match=r"expert_\d.pt: holds other weights than were written there"):
        model(ids)
    with pytest.raises(ValueError, match="already holds offloaded experts"):
        type(layers[1])(model.layers[2].ffn.experts.template, [], target, layers[1].cache)


@torch.no_grad()
def test_two_models_disk_dispatched_into_one_folder_keep_their_weights(tiny_config, tmp_path):
    ids = torch.randint(0, tiny_config.vocab_size, (1, 12))
    device_map = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "disk", "layers.2": "disk",
                  "layers.3": "disk", "norm": "cpu", "lm_head": "cpu", "vision": "cpu"}
    first, second = _model(tiny_config, 1), _model(tiny_config, 2)
    expected_first, expected_second = first(ids).logits, second(ids).logits
    first = dispatch_with_offload(first, device_map, tmp_path)
    second = dispatch_with_offload(second, device_map, tmp_path)
    torch.testing.assert_close(first(ids).logits, expected_first)
    torch.testing.assert_close(second(ids).logits, expected_second)
