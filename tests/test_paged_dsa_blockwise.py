"""Block-wise paged DSA (latentmoe_lab/ops/paged_sparse.py) against the gather path it replaces
(docs/design.md §1.4, §6.3).

The reference twin is what GatedDSA's paged_reads="gather" does: copy each sequence's context out of the
pool through its block table (sequence_positions, or gather_left_padded for a batch of decodes) and call
index_topk / sparse_attention on it. Selected positions must be identical (tie rule: equal scores go to
the earlier position; the indexer's ReLU makes exact ties common, and a test forces them), outputs equal to
1e-5. Shapes are ragged: contexts not a multiple of the block size, chunks of one token, contexts shorter
than the top-k, several sequences (decodes of different lengths) in one call, key ranges of one block.
"""
from __future__ import annotations

import random

import pytest
import torch

from latentmoe_lab.analysis.memory import PeakMemory
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers import dsa_indexer, dsa_paged
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.dsa_paged import gather_left_padded, sequence_positions
from latentmoe_lab.ops.paged_sparse import paged_dense_attention, paged_index_topk, paged_sparse_attention
from latentmoe_lab.ops.sparse_attention import index_topk, sparse_attention
from latentmoe_lab.paged_pools import DSAPool, PagedPools

CONFIG = ModelConfig.from_preset("tiny")
HI, DI = CONFIG.indexer.num_heads, CONFIG.indexer.head_dim
# (context, new tokens) per sequence: a fresh prefill, one-token chunks, contexts shorter than top-k = 32,
# contexts and ends that are not multiples of the block size, and one context spanning many blocks.
SEQUENCES = [(0, 9), (5, 1), (37, 1), (100, 7), (3, 1), (20, 40), (130, 1)]


def _pool(block_size: int, dtype: torch.dtype, seed: int = 0, num_blocks: int = 64) -> DSAPool:
    """The tiny model's DSA pool with every position holding random rows."""
    pools = PagedPools(CONFIG, num_blocks, block_size, num_slots=1, dtype=dtype)
    pool = next(p for p in map(pools.layer, range(CONFIG.num_layers)) if isinstance(p, DSAPool))
    g = torch.Generator().manual_seed(seed)
    count = num_blocks * block_size
    pool.write(torch.arange(count), torch.randn(count, pool.latent_dim, generator=g, dtype=dtype),
               torch.randn(count, pool.index_dim, generator=g, dtype=dtype))
    return pool


def _batch(block_size: int, num_blocks: int = 64, seed: int = 0) -> ForwardBatch:
    """SEQUENCES as one ForwardBatch, blocks taken from a shuffled free list (tables are scattered)."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in SEQUENCES]
    return ForwardBatch.from_sequences([[0] * n for _, n in SEQUENCES], [c for c, _ in SEQUENCES], tables,
                                       list(range(len(SEQUENCES))), block_size)


def _readers(pool: DSAPool):
    return (lambda p: pool.latent_format.read(pool.latent, p)), (lambda p: pool.index_format.read(pool.index, p))


def _queries(batch_size: int, count: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, count, HI, DI, generator=g, dtype=dtype),
            torch.randn(batch_size, count, HI, generator=g, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_size,key_block", [(16, 1), (16, 48), (64, 2048), (7, 20)])
@pytest.mark.parametrize("k", [32, 5])
def test_prefill_chunk_selection_equals_the_gather_path(dtype, block_size, key_block, k):
    pool, batch = _pool(block_size, dtype), _batch(block_size)
    _, read_index = _readers(pool)
    for i, (context, new) in enumerate(SEQUENCES):
        q_idx, w = _queries(1, new, dtype, seed=i)
        keys_index = pool.read(sequence_positions(batch, i, context + new))[1][None]
        reference = index_topk(q_idx, keys_index, w, k, offset=context)
        query_pos = (context + torch.arange(new))[None]
        blocks = paged_index_topk(q_idx, w, query_pos, batch.block_table[i:i + 1], block_size, read_index, k,
                                  key_block)
        assert torch.equal(blocks, reference), f"sequence {i} (context {context}, {new} new)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_size,key_block", [(16, 1), (16, 2048), (7, 20)])
def test_batched_decode_selection_equals_the_left_padded_gather(dtype, block_size, key_block):
    pool, batch = _pool(block_size, dtype), _batch(block_size)
    _, read_index = _readers(pool)
    seqs = torch.tensor([i for i, (_, n) in enumerate(SEQUENCES) if n == 1])  # contexts 5, 37, 3, 130
    q_idx, w = _queries(len(seqs), 1, dtype, seed=7)
    _, keys_index, pad = gather_left_padded(batch, pool, seqs, dtype)
    padded = index_topk(q_idx, keys_index, w, 32, offset=keys_index.shape[1] - 1, first_key=pad)
    reference = torch.where(padded >= 0, padded - pad[..., None], -1)  # back to each sequence's own positions
    blocks = paged_index_topk(q_idx, w, batch.context_len[seqs][:, None], batch.block_table[seqs], block_size,
                              read_index, 32, key_block)
    assert torch.equal(blocks, reference)
    assert bool((blocks[1:2] == -1).sum() == 0) and bool((blocks[2] == -1).sum() == 32 - 4)  # 38 keys; 4 keys


def test_tied_scores_go_to_the_earlier_position():
    """Every key equal -> every score equal: the top-k are the earliest positions, in order, across ranges."""
    block_size, k = 8, 5
    pool, batch = _pool(block_size, torch.float32), _batch(block_size)
    pool.index.fill_(0.5)
    _, read_index = _readers(pool)
    q_idx, w = _queries(1, 1, torch.float32, seed=3)
    i = 3  # context 100: 13 blocks, 5 ranges of 3 blocks
    for query in (99, 4, 2):
        blocks = paged_index_topk(q_idx, w, torch.tensor([[query]]), batch.block_table[i:i + 1], block_size,
                                  read_index, k, key_block=24)
        expected = [p if p <= query else -1 for p in range(k)]
        assert blocks[0, 0].tolist() == expected
        keys = pool.read(sequence_positions(batch, i, query + 1))[1][None]
        assert torch.equal(blocks, index_topk(q_idx, keys, w, k, offset=query))


@pytest.mark.parametrize("block_size,key_block", [(16, 16), (7, 20)])
def test_sparse_attention_over_selected_rows_equals_the_gathered_context(block_size, key_block):
    pool, batch = _pool(block_size, torch.float32), _batch(block_size)
    read_latent, read_index = _readers(pool)
    heads, dim, value_dim = 2, pool.latent_dim, CONFIG.mla.kv_lora_rank
    for i, (context, new) in enumerate(SEQUENCES):
        q_idx, w = _queries(1, new, torch.float32, seed=i)
        q = torch.randn(1, new, heads, dim, generator=torch.Generator().manual_seed(100 + i))
        table = batch.block_table[i:i + 1]
        positions = paged_index_topk(q_idx, w, (context + torch.arange(new))[None], table, block_size, read_index,
                                     32, key_block)
        out = paged_sparse_attention(q, positions, table, block_size, read_latent, value_dim, scale=0.3)
        keys = pool.read(sequence_positions(batch, i, context + new))[0][None, :, None, :]
        reference = sparse_attention(q, keys, keys[..., :value_dim], positions, scale=0.3)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,key_block,query_block", [(16, 16, 64), (7, 20, 3), (64, 2048, 1)])
@torch.no_grad()
def test_layer_blocks_equals_gather_on_a_mixed_batch(block_size, key_block, query_block, monkeypatch):
    """GatedDSA's paged forward, paged_reads "blocks" vs "gather": decodes and prefill chunks in one batch.

    With paged_dense_prefix off every query goes through the indexer: both paths' selections are recorded
    (in each sequence's own positions) and must be identical. With it on (the default) the outputs still
    equal the gather path's (test_the_dense_prefix_... checks what it skips).
    """
    selected = {"gather": [], "blocks": []}

    def record_gather(q_idx, keys, w, k, offset=0, first_key=None):
        positions = index_topk(q_idx, keys, w, k, offset, first_key)
        own = positions if first_key is None else torch.where(positions >= 0, positions - first_key[..., None], -1)
        selected["gather"].append(own.reshape(-1, k))  # left-padded decodes: back to the sequence's positions
        return positions

    def record_blocks(*args):
        positions = paged_index_topk(*args)
        selected["blocks"].append(positions.reshape(-1, positions.shape[-1]))
        return positions

    monkeypatch.setattr(dsa_indexer, "index_topk", record_gather)
    monkeypatch.setattr(dsa_paged, "paged_index_topk", record_blocks)
    torch.manual_seed(0)
    layer = GatedDSA(CONFIG, query_block=query_block, key_block=key_block).eval()
    batch = _batch(block_size)
    x = torch.randn(1, batch.num_tokens, CONFIG.hidden_size)
    outputs = {}
    layer.paged_dense_prefix = False
    for reads in ("gather", "blocks"):
        layer.paged_reads = reads
        outputs[reads] = layer(x, batch=batch, pool=_pool(block_size, torch.float32))
    gathered, blockwise = torch.cat(selected["gather"]), torch.cat(selected["blocks"])
    assert gathered.shape == (batch.num_tokens, CONFIG.indexer.topk) and torch.equal(blockwise, gathered)
    torch.testing.assert_close(outputs["blocks"], outputs["gather"], atol=1e-5, rtol=1e-5)
    layer.paged_dense_prefix = True
    with_dense_prefix = layer(x, batch=batch, pool=_pool(block_size, torch.float32))
    torch.testing.assert_close(with_dense_prefix, outputs["gather"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context,new,query_block", [(0, 40, 8), (5, 30, 8), (20, 9, 4), (0, 12, 64), (31, 1, 64)])
@torch.no_grad()
def test_the_dense_prefix_covers_exactly_the_queries_that_see_at_most_topk_keys(context, new, query_block,
                                                                               monkeypatch):
    """A prefill chunk at context `context`: the queries at positions < topk (32) attend densely, cut at a query
    block boundary unless the whole chunk qualifies; the indexer scores only the others, and the output equals
    the indexer-for-all path's."""
    scored = []

    def record_blocks(*args):
        scored.append(args[2].clone())  # query_pos
        return paged_index_topk(*args)

    monkeypatch.setattr(dsa_paged, "paged_index_topk", record_blocks)
    block_size, topk = 16, CONFIG.indexer.topk
    layer = GatedDSA(CONFIG, query_block=query_block).eval()
    blocks = -(-(context + new) // block_size)
    batch = ForwardBatch.from_sequences([[1] * new], [context], [list(range(blocks))], [0], block_size)
    pool = _pool(block_size, torch.float32)  # the context's keys: random rows
    x = torch.randn(1, new, CONFIG.hidden_size, generator=torch.Generator().manual_seed(context + new))
    outputs = {}
    for dense_prefix in (False, True):
        layer.paged_dense_prefix = dense_prefix
        before = len(scored)
        outputs[dense_prefix] = layer(x, batch=batch, pool=pool)  # both write the same new keys
        scored_now = torch.cat([p.flatten() for p in scored[before:]]) if len(scored) > before else torch.empty(0)
        if dense_prefix:
            seeing_all = int(((context + torch.arange(new)) < topk).sum())
            dense = seeing_all if seeing_all == new else seeing_all // query_block * query_block
            assert scored_now.tolist() == list(range(context + dense, context + new))
        else:
            assert scored_now.tolist() == list(range(context, context + new))
    torch.testing.assert_close(outputs[True], outputs[False], atol=1e-5, rtol=1e-5)


def _peak(fn) -> int:
    with PeakMemory() as memory:
        fn()
    return memory.peak_bytes


def test_blockwise_temporaries_are_flat_in_context_length():
    """Same chunk, 4x the context: the block-wise peak stays put while the gather path's grows with it."""
    block_size, new, num_blocks = 16, 16, 80
    pool = _pool(block_size, torch.float32, num_blocks=num_blocks)
    read_latent, read_index = _readers(pool)
    q_idx, w = _queries(1, new, torch.float32, seed=0)
    q = torch.randn(1, new, 2, pool.latent_dim)
    table = torch.randperm(num_blocks)[None]
    peaks = {}
    for context in (256, 1024):
        query_pos = (context + torch.arange(new))[None]

        def blocks():
            positions = paged_index_topk(q_idx, w, query_pos, table, block_size, read_index, 32, key_block=64)
            paged_sparse_attention(q, positions, table, block_size, read_latent, CONFIG.mla.kv_lora_rank, 0.3)

        def gather():
            flat = (table[0, :, None] * block_size + torch.arange(block_size)).flatten()[:context + new]
            latent, keys_index = pool.read(flat)
            positions = index_topk(q_idx, keys_index[None], w, 32, offset=context)
            sparse_attention(q, latent[None, :, None], latent[None, :, None, :CONFIG.mla.kv_lora_rank], positions)

        peaks[context] = (_peak(blocks), _peak(gather))
    (blocks_short, gather_short), (blocks_long, gather_long) = peaks[256], peaks[1024]
    assert blocks_long <= 1.02 * blocks_short, peaks
    assert gather_long >= 2.5 * gather_short, peaks  # the effect is real: the reference grows


def test_bad_arguments_name_the_argument():
    pool, batch = _pool(16, torch.float32), _batch(16)
    read_latent, read_index = _readers(pool)
    q_idx, w = _queries(1, 2, torch.float32, seed=0)
    table = batch.block_table[:1]
    with pytest.raises(ValueError, match="query_pos: reaches past a sequence"):
        paged_index_topk(q_idx, w, torch.tensor([[15, 16]]), table, 16, read_index, 4)  # 9 tokens: one block
    with pytest.raises(ValueError, match="query_pos: reaches 9999"):
        paged_index_topk(q_idx, w, torch.tensor([[15, 9999]]), table, 16, read_index, 4)
    with pytest.raises(ValueError, match="query_pos: expected shape"):
        paged_index_topk(q_idx, w, torch.tensor([[1]]), table, 16, read_index, 4)
    with pytest.raises(TypeError, match="query_pos: expected an int64"):
        paged_index_topk(q_idx, w, torch.tensor([[0.0, 1.0]]), table, 16, read_index, 4)
    with pytest.raises(ValueError, match="key_block: expected a positive int"):
        paged_index_topk(q_idx, w, torch.tensor([[0, 1]]), table, 16, read_index, 4, key_block=0)
    with pytest.raises(ValueError, match="block_table: expected"):
        paged_index_topk(q_idx, w, torch.tensor([[0, 1]]), torch.tensor([[-1, 2]]), 16, read_index, 4)
    with pytest.raises(ValueError, match="positions: values must be -1 or"):
        paged_sparse_attention(torch.randn(1, 2, 2, pool.latent_dim), torch.tensor([[[0], [16]]]), table, 16,
                               read_latent, 16, 0.3)
    with pytest.raises(ValueError, match="key_block: expected a positive integer"):
        GatedDSA(CONFIG, key_block=0)
    layer = GatedDSA(CONFIG)
    layer.paged_reads = "all"
    with pytest.raises(ValueError, match="paged_reads: expected one of"):
        layer(torch.randn(1, batch.num_tokens, CONFIG.hidden_size), batch=batch, pool=pool)


@torch.no_grad()
def test_paged_dense_attention_equals_sparse_attention_over_every_visible_key():
    """Ragged rows (each its own context, fewer blocks for the shorter ones, scattered tables): dense attention
    over keys 0..query_pos equals paged_sparse_attention on positions that list exactly those keys."""
    block_size, value_dim = 7, 16
    pool = _pool(block_size, torch.float32)
    read_latent, _ = _readers(pool)
    query_pos = torch.tensor([[3, 4, 5], [20, 21, 22], [0, 1, 2]])
    free = list(range(64))
    random.Random(3).shuffle(free)
    blocks = [-(-(int(row.max()) + 1) // block_size) for row in query_pos]
    table = torch.full((3, max(blocks)), -1, dtype=torch.long)
    for row, count in enumerate(blocks):
        table[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    q = torch.randn(3, 3, 4, pool.latent_dim, generator=torch.Generator().manual_seed(5))
    keys = torch.arange(int(query_pos.max()) + 1)
    positions = torch.where(keys <= query_pos[..., None], keys, -1)  # [B, T, N]: every visible key, -1 after
    sparse = paged_sparse_attention(q, positions, table, block_size, read_latent, value_dim, scale=0.3)
    dense = paged_dense_attention(q, query_pos, table, block_size, read_latent, value_dim, scale=0.3)
    torch.testing.assert_close(dense, sparse, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="value_dim"):
        paged_dense_attention(q, query_pos, table, block_size, read_latent, pool.latent_dim + 1, scale=0.3)
    with pytest.raises(ValueError, match="query_pos: expected shape"):
        paged_dense_attention(q, query_pos[:, :2], table, block_size, read_latent, value_dim, scale=0.3)
    with pytest.raises(ValueError, match="past a sequence's last block"):  # row 2 holds one block: positions 0-6
        paged_dense_attention(q, query_pos + torch.tensor([[0], [0], [5]]), table, block_size, read_latent,
                              value_dim, scale=0.3)


def test_paged_dense_attention_gradients_equal_its_sparse_twin():
    """Gradients of q and of the pool's latent rows, fp64, ragged rows (one sequence one block short):
    the dense form against paged_sparse_attention on positions listing every visible key."""
    block_size, value_dim, dim = 5, 6, 10
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(40, dim, generator=g, dtype=torch.float64, requires_grad=True)  # 8 blocks of 5
    table = torch.tensor([[6, 1, 3], [2, 7, -1]])
    query_pos = torch.tensor([[9, 10, 11, 12], [4, 5, 6, 7]])
    q = torch.randn(2, 4, 3, dim, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 4, 3, value_dim, generator=g, dtype=torch.float64)
    keys = torch.arange(int(query_pos.max()) + 1)
    positions = torch.where(keys <= query_pos[..., None], keys, -1)
    grads = []
    for attend in (lambda: paged_sparse_attention(q, positions, table, block_size, lambda p: latent[p], value_dim,
                                                  scale=0.4),
                   lambda: paged_dense_attention(q, query_pos, table, block_size, lambda p: latent[p], value_dim,
                                                 scale=0.4)):
        out = attend()
        grads.append((out, *torch.autograd.grad(out, (q, latent), upstream)))
    for dense, sparse in zip(grads[1], grads[0]):
        torch.testing.assert_close(dense, sparse, atol=1e-12, rtol=1e-10)
    assert grads[1][2].abs().sum() > 0  # the latent rows do get a gradient


# Verify steps of speculative decoding (2-5 rows each) beside a decode and a prefill chunk: contexts below
# top-k = 32 with every row dense, steps that cross it, and long contexts.
VERIFY_SEQUENCES = [(3, 4), (10, 2), (29, 5), (30, 3), (64, 4), (100, 2), (7, 1), (0, 12), (131, 5)]


def _verify_batch(block_size: int) -> ForwardBatch:
    """VERIFY_SEQUENCES as one batch; every sequence with more than one new token after a context of at
    least one is a verify step (spec_slots row set), the fresh 12-token prompt a chunk."""
    free = list(range(64))
    random.Random(1).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in VERIFY_SEQUENCES]
    batch = ForwardBatch.from_sequences([[0] * n for _, n in VERIFY_SEQUENCES], [c for c, _ in VERIFY_SEQUENCES],
                                        tables, list(range(len(VERIFY_SEQUENCES))), block_size)
    width = max(n for _, n in VERIFY_SEQUENCES)
    spec = torch.full((len(VERIFY_SEQUENCES), width), -1, dtype=torch.long)
    next_slot = len(VERIFY_SEQUENCES)
    for i, (context, new) in enumerate(VERIFY_SEQUENCES):
        if context > 0 and new > 1:
            spec[i, 0] = i
            spec[i, 1:new] = torch.arange(next_slot, next_slot + new - 1)
            next_slot += new - 1
    batch.spec_slots = spec
    batch.check(num_blocks=64, num_slots=next_slot, max_positions=10_000)
    return batch


@pytest.mark.parametrize("block_size,key_block,query_block", [(16, 16, 64), (7, 20, 3), (64, 2048, 8)])
@pytest.mark.parametrize("dense_prefix", [False, True])
@torch.no_grad()
def test_verify_steps_attend_batched_with_the_selection_of_one_call_each(block_size, key_block, query_block,
                                                                         dense_prefix, monkeypatch):
    """"blocks" groups the verify steps into few calls (batched_verify_groups, left_padded_rows). Every real
    row's indexer selection equals the one-call-per-step path's exactly, and the outputs equal it and the
    gather twin's; a step longer than query_block keeps its own call."""
    calls, selected = [], {}

    def record_blocks(q_idx, w, query_pos, block_table, *rest):
        positions = paged_index_topk(q_idx, w, query_pos, block_table, *rest)
        calls.append(query_pos.shape)
        for b in range(query_pos.shape[0]):  # keyed by (first block: the sequence, position); padding rows
            for t in range(query_pos.shape[1]):  # come first and repeat the first real row, which overwrites them
                selected[(int(block_table[b, 0]), int(query_pos[b, t]))] = positions[b, t]
        return positions

    monkeypatch.setattr(dsa_paged, "paged_index_topk", record_blocks)
    torch.manual_seed(0)
    layer = GatedDSA(CONFIG, query_block=query_block, key_block=key_block).eval()
    layer.paged_dense_prefix = dense_prefix
    batch = _verify_batch(block_size)
    x = torch.randn(1, batch.num_tokens, CONFIG.hidden_size)
    outputs, selections, call_counts = {}, {}, {}
    for name in ("batched", "one call each", "gather"):
        layer.paged_reads = "gather" if name == "gather" else "blocks"
        with monkeypatch.context() as patch:
            if name == "one call each":
                patch.setattr(dsa_paged, "batched_verify_groups", lambda *args: [])
            calls.clear(), selected.clear()
            outputs[name] = layer(x, batch=batch, pool=_pool(block_size, torch.float32))
            selections[name], call_counts[name] = dict(selected), len(calls)
    assert selections["batched"].keys() == selections["one call each"].keys()
    assert all(torch.equal(selections["batched"][key], row) for key, row in selections["one call each"].items())
    torch.testing.assert_close(outputs["batched"], outputs["one call each"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outputs["batched"], outputs["gather"], atol=1e-5, rtol=1e-5)
    groups = dsa_paged.batched_verify_groups(batch, layer)
    grouped = sorted(i for group in groups for i in group)
    long_steps = [i for i in batch.verify_indices() if VERIFY_SEQUENCES[i][1] > query_block]
    assert grouped == sorted(set(batch.verify_indices()) - set(long_steps))
    assert len(groups) < len(grouped) or not grouped
    if not dense_prefix:  # every verify step is scored: one indexer call per group instead of per step
        assert call_counts["one call each"] - call_counts["batched"] == len(grouped) - len(groups)


def test_left_padded_rows_repeat_each_steps_first_row():
    """Rows [G, W] of steps of 4 and 2 tokens: the short one padded on the left with its first row."""
    batch = _verify_batch(16)
    rows, real, query_pos = dsa_paged.left_padded_rows(batch, [0, 1])  # (3, 4) and (10, 2)
    assert rows.tolist() == [[0, 1, 2, 3], [4, 4, 4, 5]]
    assert real.tolist() == [[True] * 4, [False, False, True, True]]
    assert query_pos.tolist() == [[3, 4, 5, 6], [10, 10, 10, 11]]
