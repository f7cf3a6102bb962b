"""K3 storage rules (interop/k3_storage.py): compressed-tensors MXFP4 bytes are quant/weight_mxfp4.py's bytes, the
A_log padding rule, and the quantization_config check."""
from __future__ import annotations

import pytest
import torch

from latentmoe_lab.interop import k3_storage as storage
from latentmoe_lab.quant.weight_mxfp4 import MXFP4Format


def test_nibble_order_and_scale_follow_compressed_tensors():
    # element 2j in the low nibble: codes 1 (0.5) then 7 (6.0) -> byte 0x71; scale 127 -> x1, 128 -> x2
    packed = torch.tensor([[0x71] * 16, [0x71] * 16], dtype=torch.uint8)
    scale = torch.tensor([[127], [128]], dtype=torch.uint8)
    values = storage.unpack_matrix(packed, scale)
    assert values[0, :2].tolist() == [0.5, 6.0] and values[1, :2].tolist() == [1.0, 12.0]


def test_packing_is_our_mxfp4_layout_and_round_trips_on_the_grid():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    packed, scale = storage.pack_matrix(weight)
    ours = MXFP4Format().pack(weight)
    assert torch.equal(packed, ours["data"]) and torch.equal(scale, ours["scale"])
    assert packed.shape == (8, 32) and scale.shape == (8, 2)
    decoded = storage.unpack_matrix(packed, scale)
    again = storage.pack_matrix(decoded)
    assert torch.equal(storage.unpack_matrix(*again), decoded)  # values on the grid survive a re-pack exactly
    with pytest.raises(ValueError, match="divisible by 32"):
        storage.pack_matrix(torch.zeros(4, 48), "w1")
    with pytest.raises(ValueError, match="not one matrix"):
        storage.unpack_matrix(packed, scale[:, :1], "w1")


def test_a_log_padding():
    a_log = torch.tensor([0.1, 0.2, 0.3])
    stored = storage.pad_a_log(a_log)
    assert stored.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.0]) and storage.a_log_stored_size(96) == 128
    assert torch.equal(storage.narrow_a_log(stored, 3, "A_log"), a_log)
    stored[3] = 1.0
    with pytest.raises(ValueError, match="A_log: values past num_heads=3 must be zero"):
        storage.narrow_a_log(stored, 3, "A_log")
    with pytest.raises(ValueError, match="at least num_heads=5"):
        storage.narrow_a_log(stored, 5, "A_log")


def test_quantization_config_check():
    assert storage.check_quantization_config(storage.quantization_config()) is True
    assert storage.check_quantization_config(None) is False
    bad = storage.quantization_config()
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ValueError, match="group_size"):
        storage.check_quantization_config(bad)
    with pytest.raises(ValueError, match="quant_method"):
        storage.check_quantization_config({**storage.quantization_config(), "quant_method": "gptq"})
    names = storage.packed_names("a.experts.0.w1.weight")
    assert names == ("a.experts.0.w1.weight_packed", "a.experts.0.w1.weight_scale")
    assert storage.stored_dtype("x.self_attn.A_log") == torch.float32
    assert storage.stored_dtype("x.self_attn.q_proj.weight") == torch.bfloat16
