"""Issue 43 item 1: 4-bit lightning-indexer keys (quant/kv_index4.py, memory.index_key_dtype int4 | fp4).

The format against its plain reference twin on ragged shapes, the exact top-k on keys it represents exactly,
the recall of the selected set on random keys (reported, and equal to what the reference twin gives), the
bytes the planner counts against what the pools allocate, and the engine's greedy tokens against the
contiguous codec twin, with and without a host tier."""
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.ops.paged_sparse import paged_index_topk
from latentmoe_lab.ops.sparse_attention import index_topk
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import HARDWARE
from latentmoe_lab.parallel.roofline import decode_roofline
from latentmoe_lab.quant.kv import INDEX_KEY_DTYPES, kv_bytes_per_token, kv_formats
from latentmoe_lab.quant.kv_cache import quantized_kv_cache
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat
from latentmoe_lab.quant.kv_index4 import FP4_MAGNITUDES, FourBitIndexFormat, fake_quantize_keys, selection_recall
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving import config as service_config
from latentmoe_lab.serving.cache_tiers.offload_plan import request_tier_bytes
from latentmoe_lab.serving.planner import allocate_pools, plan_cache

DTYPES = ("int4", "fp4")


def _keys(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Layer-normed random keys (what LightningIndexer.keys stores), with an outlier channel and a zero row."""
    g = torch.Generator().manual_seed(seed)
    keys = F.layer_norm(torch.randn(n, dim, generator=g), (dim,))
    keys[:, min(3, dim - 1)] *= 8
    keys[0] = 0
    return keys


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, group", [(1, 32), (7, 32), (16, 32), (33, 32), (64, 32), (128, 32), (40, 8)])
def test_pool_round_trip_equals_the_reference_twin_on_ragged_shapes(dtype, dim, group):
    fmt, block_size, num_blocks = FourBitIndexFormat(dim, dtype, group), 5, 7
    values = _keys(23, dim, seed=dim)
    storage = fmt.allocate(num_blocks, block_size, dim, None)
    assert storage.numel() == num_blocks * block_size * (-(-dim // 2) + 2 * -(-dim // group))
    positions = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:23]
    fmt.write(storage, positions, values)
    reference = fake_quantize_keys(values, dtype, group)
    assert torch.equal(fmt.read(storage, positions), reference)
    assert torch.equal(fmt.read(storage, positions.flip(0)), reference.flip(0))  # any order, any block
    assert torch.equal(reference[0], torch.zeros(dim))  # an all-zero group decodes to zeros
    # The stated bound: half a code step of the group's scale s, the widest step being 1 x s in int4 and
    # 2 x s in fp4 (between 4 and 6); a little more where the fp16 scale rounded down and a value saturates.
    groups = F.pad(values, (0, -dim % group)).unflatten(-1, (-1, group)).abs().amax(-1)
    scale = (groups / (7 if dtype == "int4" else 6)).repeat_interleave(group, -1)[:, :dim]
    widest_step = 1 if dtype == "int4" else 2
    assert bool(((reference - values).abs() <= scale * widest_step / 2 * (1 + 2 ** -8)).all())


def test_untouched_rows_stay_zero_and_writes_do_not_spill_into_neighbours():
    fmt = FourBitIndexFormat(33, "int4")
    storage = fmt.allocate(2, 4, 33, None)
    fmt.write(storage, torch.tensor([5]), _keys(2, 33)[1:])
    others = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    assert torch.equal(fmt.read(storage, others), torch.zeros(7, 33))


def _representable(n: int, dim: int, dtype: str, seed: int) -> torch.Tensor:
    """Keys every group of which a 4-bit format holds exactly: grid values x a power of two, each group's
    absmax on the grid's largest value (so the scale the format computes is that power of two)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(-7.0, 8.0) if dtype == "int4" else torch.tensor(
        [s * m for m in FP4_MAGNITUDES for s in (1.0, -1.0)])
    values = grid[torch.randint(0, len(grid), (n, dim), generator=g)]
    values[:, ::32] = grid.abs().max() * torch.where(torch.rand(n, 1, generator=g) < 0.5, 1.0, -1.0)
    return values * 2.0 ** torch.randint(-3, 2, (n, 1), generator=g).float() / 4


def _paged_topk(fmt, keys: torch.Tensor, q_idx, w, query_pos, k: int, block_size: int = 16) -> torch.Tensor:
    """paged_index_topk over a pool whose blocks are shuffled, keys stored through `fmt`."""
    num_blocks = -(-keys.shape[1] // block_size)
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))
    storage = fmt.allocate(num_blocks, block_size, keys.shape[-1], None)
    token = torch.arange(keys.shape[1])
    fmt.write(storage, blocks[token // block_size] * block_size + token % block_size, keys[0])
    return paged_index_topk(q_idx, w, query_pos, blocks[None], block_size, lambda p: fmt.read(storage, p), k,
                            key_block=64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_over_exactly_representable_keys_equals_the_full_precision_reference(dtype):
    dim, keys_n, queries, k = 64, 200, 12, 24
    keys = _representable(keys_n, dim, dtype, seed=4)[None]
    assert torch.equal(fake_quantize_keys(keys[0], dtype), keys[0])
    g = torch.Generator().manual_seed(5)
    q_idx, w = torch.randn(1, queries, 4, dim, generator=g), torch.randn(1, queries, 4, generator=g)
    offset = keys_n - queries
    reference = index_topk(q_idx, keys, w, k, offset)
    query_pos = (offset + torch.arange(queries))[None]
    assert torch.equal(_paged_topk(FourBitIndexFormat(dim, dtype), keys, q_idx, w, query_pos, k), reference)


def test_selection_recall_counts_the_shared_positions_of_each_query():
    reference = torch.tensor([[[0, 1, 2, 3], [4, 5, -1, -1]]])
    selected = torch.tensor([[[3, 2, 9, 8], [5, 7, -1, -1]]])
    assert selection_recall(selected, reference) == pytest.approx((2 + 1) / (4 + 2))
    assert selection_recall(reference, reference) == 1.0
    # with the full-precision scores, a key tied at the reference's k-th score counts as a hit (9 here), one
    # below it does not (8); row 2's k-th score is 0.5, which position 7 reaches
    scores = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0],
                            [0.0, 0.0, 0.0, 0.0, 0.9, 0.5, 0.0, 0.5, 0.0, 0.0]]])
    assert selection_recall(selected, reference, scores) == pytest.approx((3 + 2) / 6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recall_on_random_keys_is_reported_and_equals_the_reference_twins(dtype, record_property, capsys):
    """Random layer-normed keys at k3-2.8t's d_I 128, 2048 keys, top-256: the recall of the 4-bit pool's selection
    against full-precision keys, next to the fp8 pool's. Asserted exactly against the reference twin (the same
    selection from fake_quantize_keys), not against a loose floor; the figure itself is reported."""
    dim, keys_n, queries, k = 128, 2048, 16, 256
    keys = _keys(keys_n, dim, seed=7)[None]
    g = torch.Generator().manual_seed(8)
    q_idx, w = torch.randn(1, queries, 8, dim, generator=g), torch.rand(1, queries, 8, generator=g)
    offset = keys_n - queries
    query_pos = (offset + torch.arange(queries))[None]
    full = index_topk(q_idx, keys, w, k, offset)
    four_bit = _paged_topk(FourBitIndexFormat(dim, dtype), keys, q_idx, w, query_pos, k)
    twin = index_topk(q_idx, fake_quantize_keys(keys[0], dtype)[None], w, k, offset)
    assert torch.equal(four_bit, twin)
    fp8 = _paged_topk(QuantizedIndexFormat(dim, "fp8"), keys, q_idx, w, query_pos, k)
    recall, recall_fp8 = selection_recall(four_bit, full), selection_recall(fp8, full)
    record_property(f"recall_{dtype}", recall)
    with capsys.disabled():
        print(f"\n[random layer-normed keys, d_I {dim}, {keys_n} keys, top-{k}] recall {dtype} {recall:.4f}, "
              f"fp8 {recall_fp8:.4f}")
    assert 0.0 <= recall <= 1.0


def test_bytes_per_token_and_the_key_lists_agree():
    k3, small, tiny = (ModelConfig.from_preset(p) for p in ("k3-2.8t", "small", "tiny"))
    assert kv_bytes_per_token(k3, "fp8", index_key_dtype="int4") == {"mla": 656, "index": 64 + 4 * 2}
    assert kv_bytes_per_token(small, "fp8", index_key_dtype="fp4")["index"] == 32 + 2 * 2
    assert kv_bytes_per_token(tiny, "auto", "fp32", "int4") == {"mla": 24 * 4, "index": 8 + 2}
    assert isinstance(kv_formats(k3, "bf16", index_key_dtype="auto")[1], type(kv_formats(k3, "bf16")[1]))
    assert service_config.INDEX_KEY_DTYPES == INDEX_KEY_DTYPES
    with pytest.raises(ValueError, match="index_key_dtype: must be one of"):
        kv_formats(tiny, "fp8", index_key_dtype="int8")


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=16, dtype="int8"), "dtype: 4-bit index keys are one of"),
    (dict(dim=0), "dim: must be a positive integer"),
    (dict(dim=16, group=5), "group: must be even"),
    (dict(dim=16, group=True), "group: must be a positive integer"),
])
def test_bad_format_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FourBitIndexFormat(**kwargs)


def test_bad_storage_positions_and_values_name_the_argument():
    fmt = FourBitIndexFormat(16)
    storage = fmt.allocate(2, 4, 16, None)
    with pytest.raises(ValueError, match="dim: this format holds 16"):
        fmt.bytes_per_token(32)
    with pytest.raises(ValueError, match=r"positions: positions must lie in \[0, .* = 8\)"):
        fmt.read(storage, torch.tensor([8]))
    with pytest.raises(ValueError, match="values: expected shape"):
        fmt.write(storage, torch.tensor([0]), torch.randn(1, 15))
    with pytest.raises(ValueError, match="storage: expected uint8"):
        fmt.read(torch.zeros(2, 40), torch.tensor([0]))


def _service(index_key_dtype: str, offload: dict | None = None, **sections):
    memory = {"max_num_seqs": 2, "block_size": 16, "cache_bytes": 3_000_000, "index_key_dtype": index_key_dtype}
    if offload is not None:
        memory["offload"] = offload
    return ServiceConfig.from_dict({"model": {"max_model_len": 2048}, "memory": memory,
                                    "scheduler": {"max_batch_size": 4, "prefill_chunk_size": 256}, **sections})


@pytest.mark.parametrize("offload", [None, {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 40}])
def test_planned_bytes_equal_the_allocated_bytes(tiny_config, offload):
    plain, four_bit = plan_cache(tiny_config, _service("auto", offload)), plan_cache(tiny_config, _service("int4", offload))
    assert isinstance(four_bit.index_format, FourBitIndexFormat)
    assert four_bit.num_blocks > plain.num_blocks if offload is None else four_bit.block_bytes < plain.block_bytes
    pools = allocate_pools(tiny_config, four_bit)
    allocated = pools.nbytes()
    planned = four_bit.bytes_by_kind()
    assert allocated["dsa_index"] == planned["dsa_index"] == four_bit.num_blocks * 16 * (8 + 2)
    device = sum(value for kind, value in allocated.items() if not kind.startswith("host"))
    assert device == four_bit.total_bytes


def test_refused_settings_name_the_key():
    with pytest.raises(ValueError, match="memory.index_key_dtype: .*'int8'"):
        _service("int8")
    with pytest.raises(ValueError, match="memory.index_key_dtype: must be auto with disaggregation: or a memory.prefix"):
        ServiceConfig.from_dict({"memory": {"index_key_dtype": "fp4", "prefix_cache": {"host_bytes": 1_000_000}}})
    ServiceConfig.from_dict({"memory": {"index_key_dtype": "fp4", "prefix_cache": {}}})  # caching without a spill
    with pytest.raises(ValueError, match="memory.index_key_dtype: must be auto with disaggregation"):
        ServiceConfig.from_dict({"memory": {"index_key_dtype": "int4"},
                                 "disaggregation": {"prefill_instances": 1, "decode_instances": 1}})


def test_the_tier_table_and_the_roofline_count_four_bit_keys():
    config = ModelConfig.from_preset("k3-2.8t")
    tiers = request_tier_bytes(config, 2 ** 20, "fp8", index_key_dtype="int4")
    assert tiers["device: dsa_index"] == 24 * 2 ** 20 * 72
    layout, hw = ParallelConfig(tp=8, ep=8, pp=2), HARDWARE["H200-141GB"]
    rows = decode_roofline(config, layout, hw, index_key_dtype="fp4")
    assert rows["indexer scan"]["bytes"] == 24 * 2 ** 20 * 72
    assert rows["total"]["seconds"] < decode_roofline(config, layout, hw)["total"]["seconds"]


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_greedy_equals_the_contiguous_codec_twin_with_and_without_a_host_tier(model, dtype):
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()  # > top-32
    params = SamplingParams(max_tokens=5)
    offload = {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 40}
    served = [Engine(model, _service(dtype, tier)).generate([prompt], params, use_tqdm=False)[0].token_ids
              for tier in (None, offload)]
    cache, ids = quantized_kv_cache(model.config, "fp32", "fp32", dtype), torch.tensor([prompt])
    for step in range(5):
        logits = model(ids if step == 0 else ids[:, -1:], cache=cache).logits[0, -1]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    assert served[0] == served[1] == ids[0, len(prompt):].tolist()
