"""A request's pool rows as stored bytes (serving/transport/pool_rows.py) against the formats' own read path:
bytes moved between pools of other block sizes and positions read back as the same values, every format."""
import pytest
import torch

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.serving.cache_tiers.offload_tier import OffloadedPools
from latentmoe_lab.paged_pools import PagedPools, PlainFormat
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat
from latentmoe_lab.quant.kv_mla import QuantizedLatentFormat
from latentmoe_lab.serving.transport.pool_rows import (read_request_rows, read_token_bytes, token_byte_offsets,
                                                    write_request_rows, write_token_bytes)

FORMATS = {"fp32": lambda dim: PlainFormat(torch.float32), "bf16": lambda dim: PlainFormat(torch.bfloat16),
           "fp8 latent": lambda dim: QuantizedLatentFormat(dim - 8, 8, "fp8"),
           "int8 latent": lambda dim: QuantizedLatentFormat(dim - 8, 8, "int8"),
           "fp8 index": lambda dim: QuantizedIndexFormat(dim, "fp8"),
           "int8 index": lambda dim: QuantizedIndexFormat(dim, "int8")}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dim", [24, 136])  # one scale group, and a second, smaller one (136 = 128 + 8)
def test_token_bytes_move_between_block_sizes(name, dim):
    fmt, generator = FORMATS[name](dim), torch.Generator().manual_seed(dim)
    source, target = fmt.allocate(6, 16, dim), fmt.allocate(13, 8, dim)
    n = 37  # ragged: not a multiple of either block size
    src_positions = torch.randperm(6 * 16, generator=generator)[:n]
    dst_positions = torch.randperm(13 * 8, generator=generator)[:n]
    fmt.write(source, src_positions, torch.randn(n, dim, generator=generator) * 3)
    rows = read_token_bytes(fmt, source, dim, src_positions)
    assert rows.shape == (n, fmt.bytes_per_token(dim)) and rows.dtype == torch.uint8
    write_token_bytes(fmt, target, dim, dst_positions, rows)
    assert torch.equal(fmt.read(target, dst_positions), fmt.read(source, src_positions))
    assert torch.equal(read_token_bytes(fmt, target, dim, dst_positions), rows)
    # every stored byte of a pool belongs to exactly one token
    every = token_byte_offsets(fmt, target, dim, torch.arange(13 * 8)).flatten().sort().values
    assert torch.equal(every, torch.arange(target.numel() * target.element_size()))


def test_unknown_format_is_refused():
    with pytest.raises(TypeError, match="format: a transfer knows the byte layouts"):
        token_byte_offsets(object(), torch.zeros(1, 1, 1), 1, torch.zeros(1, dtype=torch.int64))


def test_an_import_into_the_host_tier_drops_stale_hot_copies():
    """memory.offload: rows written by a transfer go to the host tier, and a hot copy of those positions left
    by the slot's previous sequence must not be served (the host tier's own writes drop them the same way)."""
    config = ModelConfig.from_preset("tiny")
    pools = OffloadedPools(config, num_blocks=4, block_size=16, num_slots=2, hot_rows=40, hot_slots=2)
    source = PagedPools(config, num_blocks=4, block_size=16, num_slots=2)
    positions, generator = torch.arange(20), torch.Generator().manual_seed(0)
    dsa = config.layer_types.index(DSA)
    for target in (pools, source):
        target.layer(dsa).write(positions, torch.randn(20, 24, generator=generator),
                                torch.randn(20, config.indexer.head_dim, generator=generator))
    stale = pools.layer(dsa).hot_reader([1])(positions)  # the previous sequence's rows, now hot in slot 1
    write_request_rows(pools, positions, 1, read_request_rows(source, positions, 1))
    fresh = pools.layer(dsa).hot_reader([1])(positions)
    assert torch.equal(fresh, source.layer(dsa).read(positions)[0]) and not torch.equal(fresh, stale)
