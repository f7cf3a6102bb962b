"""PagedPools, the KV format protocol, slot helpers and ForwardBatch checks (docs/design.md §6.2-6.4)."""
from __future__ import annotations

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.config import DSA, KDA
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.paged_pools import DSAPool, KDAPool, PagedPools, PlainFormat, paged_pool_bytes


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_preset("tiny")


class HalfWidthFormat:
    """A stand-in codec: 1 byte per value (uint8 storage), values rounded to multiples of 1/16 in [-8, 8)."""

    def bytes_per_token(self, dim):
        return dim

    def allocate(self, num_blocks, block_size, dim, device=None):
        return torch.zeros(num_blocks, block_size, dim, dtype=torch.uint8, device=device)

    def write(self, storage, slot_mapping, values):
        codes = (values * 16).round().clamp(-128, 127).to(torch.int16) + 128
        storage.view(-1, storage.shape[-1])[slot_mapping] = codes.to(torch.uint8)

    def read(self, storage, positions):
        return (storage.view(-1, storage.shape[-1])[positions].float() - 128) / 16


class WrongSizeFormat(HalfWidthFormat):
    def allocate(self, num_blocks, block_size, dim, device=None):
        return torch.zeros(num_blocks, block_size + 1, dim, dtype=torch.uint8, device=device)


@pytest.mark.parametrize("dtype, latent_format, index_format", [
    (torch.float32, None, None), (torch.bfloat16, None, None), (torch.float32, HalfWidthFormat(), None),
    (torch.float16, PlainFormat(torch.float32), HalfWidthFormat()),
])
@pytest.mark.parametrize("num_blocks, block_size, num_slots", [(5, 16, 3), (2, 64, 1), (0, 16, 0)])
def test_allocated_bytes_equal_the_pure_count(config, dtype, latent_format, index_format, num_blocks, block_size,
                                               num_slots):
    pools = PagedPools(config, num_blocks, block_size, num_slots, dtype, latent_format=latent_format,
                       index_format=index_format)
    planned = paged_pool_bytes(config, num_blocks, block_size, num_slots, dtype, latent_format, index_format)
    assert pools.nbytes() == planned
    # and the count itself, written out for the tiny preset: 1 DSA layer, 3 KDA layers
    latent_bytes = (latent_format or PlainFormat(dtype)).bytes_per_token(16 + 8)
    index_bytes = (index_format or PlainFormat(dtype)).bytes_per_token(16)
    element = torch.empty((), dtype=dtype).element_size()
    assert planned == {"dsa_latent": num_blocks * block_size * latent_bytes,
                       "dsa_index": num_blocks * block_size * index_bytes,
                       "kda_state": 3 * num_slots * 2 * 16 * 16 * 4,
                       "kda_conv": 3 * num_slots * 2 * (16 + 16 + 16) * 3 * element}


def test_layout_follows_the_layer_types(config):
    pools = PagedPools(config, 3, 16, 2)
    assert len(pools) == config.num_layers
    for i, kind in enumerate(config.layer_types):
        pool = pools.layer(i)
        if kind == DSA:
            assert isinstance(pool, DSAPool) and pool.latent.shape == (3, 16, 24) and pool.index.shape == (3, 16, 16)
        else:
            assert kind == KDA and isinstance(pool, KDAPool)
            assert pool.state.shape == (2, 2, 16, 16) and pool.state.dtype == torch.float32
            assert pool.conv.shape == (2, 96, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_format_round_trip(dtype):
    fmt = PlainFormat(dtype)
    storage = fmt.allocate(4, 16, 24, None)
    assert storage.shape == (4, 16, 24) and storage.numel() * storage.element_size() == 64 * fmt.bytes_per_token(24)
    positions = torch.randperm(64)[:20]
    values = torch.randn(20, 24)
    fmt.write(storage, positions, values)
    torch.testing.assert_close(fmt.read(storage, positions), values.to(dtype), atol=0, rtol=0)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[positions] = False
    assert bool((storage.view(64, 24)[untouched] == 0).all())
    flat = positions[0]
    torch.testing.assert_close(storage[flat // 16, flat % 16], values[0].to(dtype))  # flat = block * bs + offset


def test_custom_format_runs_through_the_model(config):
    """A codec plugged in from outside is what attention reads back: tokens attend over the decoded keys."""
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config).eval()
    ids = torch.randint(0, 250, (40,)).tolist()
    outs = {}
    for name, fmt in (("plain", None), ("coarse", HalfWidthFormat())):
        pools = PagedPools(config, 4, 16, 1, latent_format=fmt, index_format=fmt)
        batch = ForwardBatch.from_sequences([ids], [0], [[2, 0, 3]], [0], 16)
        with torch.no_grad():
            outs[name] = model(batch.input_ids, batch=batch, pools=pools).logits
        stored = pools.layer(config.layer_types.index(DSA)).latent
        assert stored.dtype == (torch.float32 if fmt is None else torch.uint8)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(outs["plain"][0], reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs["coarse"][0], reference, atol=1e-6)  # the codec's rounding is really used
    assert bool(torch.isfinite(outs["coarse"]).all())


def test_copy_and_zero_slot(config):
    pools = PagedPools(config, 1, 16, 3)
    for pool in pools.layers:
        if isinstance(pool, KDAPool):
            pool.state.normal_()
            pool.conv.normal_()
    before = [(p.state.clone(), p.conv.clone()) for p in pools.layers if isinstance(p, KDAPool)]
    pools.copy_slot(0, 2)
    pools.zero_slot(1)
    for (state, conv), pool in zip(before, (p for p in pools.layers if isinstance(p, KDAPool))):
        assert torch.equal(pool.state[2], state[0]) and torch.equal(pool.conv[2], conv[0])
        assert torch.equal(pool.state[0], state[0])
        assert not pool.state[1].any() and not pool.conv[1].any()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_blocks=-1), ValueError, "num_blocks: must be >= 0"),
    (dict(block_size=0), ValueError, "block_size: must be >= 1"),
    (dict(num_slots=1.5), TypeError, "num_slots: expected an int"),
    (dict(dtype=torch.int32), TypeError, "dtype: expected a floating-point"),
    (dict(latent_format=object()), TypeError, "latent_format: a KV format needs"),
    (dict(index_format=WrongSizeFormat()), ValueError, "index_format: allocate\\(\\) must return"),
])
def test_bad_pool_arguments(config, kwargs, error, match):
    arguments = dict(num_blocks=2, block_size=16, num_slots=1) | kwargs
    with pytest.raises(error, match=match):
        PagedPools(config, **arguments)
    if "index_format" not in kwargs:  # the pure count checks the same arguments
        with pytest.raises(error, match=match):
            paged_pool_bytes(config, **arguments)


def test_bad_slot_ids(config):
    pools = PagedPools(config, 1, 16, 2)
    with pytest.raises(ValueError, match="dst: slot id must lie in \\[0, num_slots=2\\)"):
        pools.copy_slot(0, 2)
    with pytest.raises(TypeError, match="slot: expected an int"):
        pools.zero_slot(torch.tensor(0))


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    return LatentMoEForCausalLM(config).eval()


def _batch(**changes):
    batch = ForwardBatch.from_sequences([[1, 2, 3], [4]], [0, 17], [[0], [1, 2]], [0, 1], 16)
    for name, value in changes.items():
        setattr(batch, name, value)
    return batch


@pytest.mark.parametrize("changes, pools_kwargs, match", [
    (dict(slot_mapping=torch.tensor([0, 1, 2, 3])), {}, "batch.slot_mapping: must equal"),
    (dict(state_slot=torch.tensor([1, 1])), {}, "batch.state_slot: must be distinct"),
    (dict(state_slot=torch.tensor([0, 5])), {}, "batch.state_slot: must be distinct slot ids in \\[0, num_slots=2\\)"),
    (dict(positions=torch.tensor([0, 1, 2, 18])), {}, "batch.positions: must be context_len"),
    (dict(block_table=torch.tensor([[0, -1], [1, 9]])), {}, "batch.block_table: entries must be block ids"),
    (dict(block_table=torch.tensor([[0, -1], [-1, 2]])), {}, "batch.block_table: a sequence lacks a block"),
    (dict(query_start=torch.tensor([0, 4, 4])), {}, "batch.query_start"),
    (dict(context_len=torch.tensor([0, 17], dtype=torch.int32)), {}, "batch.context_len: expected an int64"),
    ({}, dict(block_size=64), "batch.block_size: 16 differs from the pools' 64"),
    (dict(image_features=torch.zeros(1, 64)), {}, "batch.image_features: has 1 rows for 0 image placeholder"),
    (dict(image_mask=torch.zeros(4, dtype=torch.bool)), {}, "batch.image_mask: given without"),
    (dict(decode=torch.tensor([0, 1])), {}, "batch.decode: expected a bool tensor"),
    (dict(decode=torch.tensor([True])), {}, "batch.decode: expected shape \\(2,\\)"),
])
def test_bad_batches_are_refused_before_anything_is_written(model, changes, pools_kwargs, match):
    pools = PagedPools(model.config, **(dict(num_blocks=4, block_size=16, num_slots=2) | pools_kwargs))
    batch = _batch(**changes)
    with pytest.raises((ValueError, TypeError), match=match):
        model(batch.input_ids, batch=batch, pools=pools)
    assert all(not t.any() for p in pools.layers for t in vars(p).values() if isinstance(t, torch.Tensor))


def test_model_rejects_mixed_calls(model):
    pools = PagedPools(model.config, 4, 16, 2)
    batch = _batch()
    with pytest.raises(TypeError, match="batch, pools: expected a ForwardBatch and PagedPools together"):
        model(batch.input_ids, batch=batch)
    with pytest.raises(ValueError, match="cache: not with batch="):
        model(batch.input_ids, batch=batch, pools=pools, cache=model.new_cache())
    with pytest.raises(ValueError, match="input_ids: must be batch.input_ids"):
        model(batch.input_ids + 1, batch=batch, pools=pools)
    other = ModelConfig.from_preset("tiny")
    other.indexer.head_dim = 8
    with pytest.raises(ValueError, match="pools: built for a model with different"):
        model(batch.input_ids, batch=batch, pools=PagedPools(other, 4, 16, 2))


def test_from_sequences_builds_slot_mapping_from_the_block_table():
    batch = ForwardBatch.from_sequences([[5, 6, 7], [8]], [14, 0], [[3, 1], [2]], [1, 0], 16)
    assert batch.positions.tolist() == [14, 15, 16, 0]
    assert batch.slot_mapping.tolist() == [3 * 16 + 14, 3 * 16 + 15, 1 * 16 + 0, 2 * 16]
    assert batch.query_start.tolist() == [0, 3, 4] and batch.last_token_index.tolist() == [2, 3]
    assert batch.block_table.tolist() == [[3, 1], [2, -1]]
    batch.check(num_blocks=4, num_slots=2, max_positions=4096)
    with pytest.raises(ValueError, match="block_tables: a sequence has fewer blocks"):
        ForwardBatch.from_sequences([[5, 6, 7], [8]], [14, 0], [[3], [2, 0]], [1, 0], 16)
    with pytest.raises(ValueError, match="new_tokens: needs at least one sequence"):
        ForwardBatch.from_sequences([[1], []], [0, 0], [[0], [1]], [0, 1], 16)
