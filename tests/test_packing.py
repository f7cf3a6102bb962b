"""Packed (cu_seqlens) == padded == one-by-one, layer by layer and for the whole model with images."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.packed import sequence_start_from_cu_seqlens
from latentmoe_lab.multimodal import ImageTextProcessor, pack, padding_fraction, unpack, unpad

LENGTHS = [40, 1, 7, 45]  # > and < the tiny indexer top-k (32), a one-token sequence, chunk-size misalignment


def _packed_inputs(hidden: int):
    x = torch.randn(1, sum(LENGTHS), hidden)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return x, cu_seqlens, sequence_start_from_cu_seqlens(cu_seqlens, x.shape[1])


def test_sequence_start_from_cu_seqlens():
    start = sequence_start_from_cu_seqlens(torch.tensor([0, 2, 3, 6]), 6)
    assert start.tolist() == [[0, 0, 2, 3, 3, 3]]
    for bad, match in [(torch.tensor([1, 6]), "must start at 0"), (torch.tensor([0, 3, 3, 6]), "increase strictly"),
                       (torch.tensor([0, 5]), "end at the packed length 6"), (torch.tensor([0]), "S >= 1")]:
        with pytest.raises(ValueError, match=match):
            sequence_start_from_cu_seqlens(bad, 6)
    with pytest.raises(TypeError, match="cu_seqlens"):
        sequence_start_from_cu_seqlens(torch.tensor([0.0, 6.0]), 6)


@torch.no_grad()
@pytest.mark.parametrize("gate_form", ["lower_bound", "softplus"])
def test_kda_layer_packed_equals_one_by_one(tiny_config, gate_form):
    layer = KimiDeltaAttention(tiny_config.replace(kda={**vars(tiny_config.kda), "gate_form": gate_form}))
    x, cu_seqlens, start = _packed_inputs(tiny_config.hidden_size)
    packed = layer(x, sequence_start=start)
    alone = torch.cat([layer(part) for part in x.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    leaky = layer(x)  # the same row without boundaries: later sequences see earlier ones
    assert (leaky - alone)[:, LENGTHS[0]:].abs().max() > 1e-3


def test_kda_layer_packed_backward_is_finite(tiny_config):
    layer = KimiDeltaAttention(tiny_config)
    x, _, start = _packed_inputs(tiny_config.hidden_size)
    x.requires_grad_(True)
    layer(x, sequence_start=start).square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@torch.no_grad()
@pytest.mark.parametrize("dense, absorb", [(False, None), (False, False), (True, None)])
def test_dsa_layer_packed_equals_one_by_one(tiny_config, dense, absorb):
    layer = GatedDSA(tiny_config, query_block=16)
    x, _, start = _packed_inputs(tiny_config.hidden_size)
    packed = layer(x, dense=dense, absorb=absorb, sequence_start=start)
    alone = torch.cat([layer(part, dense=dense, absorb=absorb) for part in x.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_layers_refuse_bad_sequence_start(tiny_config):
    layer = KimiDeltaAttention(tiny_config)
    x = torch.randn(1, 4, tiny_config.hidden_size)
    with pytest.raises(ValueError, match=r"sequence_start: expected shape \[B, T\]"):
        layer(x, sequence_start=torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="must lie in"):
        layer(x, sequence_start=torch.tensor([[0, 0, 3, 2]]))
    with pytest.raises(ValueError, match="cannot continue a cache"):
        GatedDSA(tiny_config)(x, cache=LatentMoEForCausalLM(tiny_config).new_cache()[3],
                              sequence_start=torch.zeros(1, 4, dtype=torch.int64))


@pytest.fixture
def mixed_batch(tiny_config):
    processor = ImageTextProcessor(tiny_config)
    texts = ["<image>What colour is the shape? It is drawn on grey noise.", "hi <image> and <image>",
             "plain text, no image, long enough to pass the DSA top-k of thirty-two.", "x"]
    images = [[torch.rand(3, 56, 56)], [torch.rand(3, 28, 84), torch.rand(3, 42, 42)], [], []]
    return processor, texts, images, processor(texts, images)


@torch.no_grad()
def test_model_packed_equals_padded_equals_unbatched(tiny_config, mixed_batch):
    model = LatentMoEForCausalLM(tiny_config).eval()
    processor, texts, images, batch = mixed_batch
    padded = unpad(model(**batch.model_inputs()).logits, batch.attention_mask)
    packed_batch = pack(batch)
    assert packed_batch.input_ids.shape == (1, sum(batch.lengths)) and padding_fraction(packed_batch) == 0
    packed = unpack(model(**packed_batch.model_inputs()).logits, packed_batch.cu_seqlens)
    for text, sample_images, from_padded, from_packed in zip(texts, images, padded, packed):
        alone = model(**processor(text, sample_images).model_inputs()).logits[0]
        torch.testing.assert_close(from_padded, alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(from_packed, alone, atol=1e-5, rtol=1e-5)


def test_model_refuses_bad_packing(tiny_config, mixed_batch):
    model = LatentMoEForCausalLM(tiny_config)
    _, _, _, batch = mixed_batch
    with pytest.raises(ValueError, match=r"needs one row \[1, total\]"):
        model(batch.input_ids, cu_seqlens=torch.tensor([0, batch.input_ids.shape[1]]))
    packed = pack(batch)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences cannot continue a cache"):
        model(packed.input_ids, cache=model.new_cache(), cu_seqlens=packed.cu_seqlens)
    with pytest.raises(ValueError, match="already packed"):
        pack(packed)
    left_padded = type(batch)(**{**vars(batch), "attention_mask": batch.attention_mask.flip(1)})
    with pytest.raises(ValueError, match="expected right padding"):
        pack(left_padded)
