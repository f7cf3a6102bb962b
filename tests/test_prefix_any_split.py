"""Hybrid prefix hits at any block boundary (serving/prefix_hits.py, docs/design.md §6.5).

The DSA hit (cached blocks) and the KDA hit (the snapshot nearest before it) are found apart; the tail between
them is recomputed, and a chunk ends at the DSA hit so that a snapshot is left there. Exactness is checked bit
for bit under scheduler.batch_invariant, on the tiny preset with a DSA query block of 16 (a chunk grid of 16,
so that blocks of 16 tokens are allowed and a 3-block prompt has 47 split points).
"""
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.server.prom import ServerMetrics
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.invariance import recorded_logits
from latentmoe_lab.serving.prefix_hits import PrefixHit, PrefixHits, find_prefix_hit
from latentmoe_lab.serving.scheduler import Scheduler
from latentmoe_lab.serving.sequence import Sequence

BLOCK = 16
KINDS = ("prefix_hit_tokens", "prefix_dsa_hit_tokens", "prefix_kda_snapshots_reused", "prefix_tokens_recomputed")


@pytest.fixture(scope="module")
def grid16_model():
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    for block in model.layers:
        if hasattr(block.attn, "query_block"):
            block.attn.query_block = BLOCK  # the KDA chunk is 16 already
    assert model.chunk_grid() == BLOCK
    return model


def service(prefix=True, snapshots=None, chunk=32):
    memory = {"cache_bytes": 8 << 20, "block_size": BLOCK, "max_num_seqs": 4}
    if prefix:
        memory["prefix_cache"] = {"enabled": True, "snapshot_slots": snapshots}
    return ServiceConfig.from_dict({"model": {"max_model_len": 128}, "memory": memory,
                                    "scheduler": {"prefill_chunk_size": chunk, "batch_invariant": True}})


def tokens(n, seed, low=0, high=256):
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(engine, prompt, max_tokens=2):
    """Run one request alone -> ({position: logits row sampled from}, the per-kind counts it added)."""
    before = {k: engine.stats()[k] for k in KINDS}
    with recorded_logits(engine) as rows:
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens), use_tqdm=False)[0]
    assert out.finish_reason == "length"
    return {pos: row for (_, pos), row in rows.items()}, {k: engine.stats()[k] - before[k] for k in KINDS}


def fresh_rows(model, prompt, max_tokens=2):
    return serve(Engine(model, service(prefix=False)), prompt, max_tokens)[0]


def assert_same_rows(got, want):
    assert got.keys() == want.keys() and all(torch.equal(got[p], want[p]) for p in want)


def assert_nothing_held(engine):
    bm = engine.block_manager
    assert bm.blocks_used == 0 and bm.slots_used == 0
    assert len(bm.free_snapshot_rows) + bm.snapshots_held == bm.num_snapshots  # no snapshot row lost


# ---------------------------------------------------------------- without a model
def test_the_dsa_hit_and_the_kda_hit_are_found_apart():
    bm = BlockManager(num_blocks=8, block_size=4, num_slots=1, num_snapshots=2, enable_prefix_caching=True)
    blocks = bm.allocate_blocks(3)
    hashes = [b"h0", b"h1", b"h2"]
    for block_hash, block in zip(hashes, blocks):
        bm.register_block(block_hash, block)
    assert bm.cached_chain_length(hashes + [b"h3"]) == 3 and bm.cached_chain_length([b"x"] + hashes) == 0
    miss = find_prefix_hit(bm, hashes)  # rows cached, no state anywhere: resume from zero, recompute 12
    assert (miss.blocks, miss.snapshot_row, miss.kda_tokens, miss.dsa_tokens, miss.tail) == ([], None, 0, 12, 12)
    row = bm.snapshot_row_for(b"h0")
    hit = find_prefix_hit(bm, hashes)
    assert (hit.blocks, hit.snapshot_row, hit.kda_tokens, hit.dsa_tokens) == ([blocks[0]], row, 4, 12)
    assert bm.ref_count[blocks[0]] == 2 and bm.ref_count[blocks[1]] == 1  # only [0, s) is shared
    off = BlockManager(num_blocks=2, block_size=4, num_slots=1)
    assert off.cached_chain_length(hashes) == 0


def test_a_chunk_ends_at_the_pending_cut_then_at_block_boundaries():
    hits = PrefixHits(block_size=4)
    seq = Sequence(0, list(range(1, 40)), SamplingParams())
    hits.expect(seq, PrefixHit(kda_tokens=8, dsa_tokens=8))  # no tail: no cut
    assert hits.chunk_end(seq, 10) == 8 and hits.chunk_end(seq, 3) == 3
    tail = PrefixHit(kda_tokens=4, dsa_tokens=12)
    hits.cut_at_dsa_hit = False
    hits.expect(seq, tail)
    assert hits.chunk_end(seq, 30) == 28  # the rule before: no cut at the DSA hit
    hits.cut_at_dsa_hit = True
    hits.expect(seq, tail)
    seq.num_computed = 4
    assert hits.chunk_end(seq, 10) == 8  # the cut lies beyond this chunk: kept for a later one
    assert hits.chunk_end(seq, 30) == 12 and hits.chunk_end(seq, 30) == 28  # used once
    hits.expect(seq, tail)
    hits.forget(seq)
    assert hits.chunk_end(seq, 30) == 28


def test_a_snapshot_at_the_dsa_hit_leaves_no_tail():
    copies = []
    bm = BlockManager(num_blocks=32, block_size=4, num_slots=2, num_snapshots=4, enable_prefix_caching=True)
    sched = Scheduler(bm, 2, 32, True, lambda src, dst: copies.append((src, dst)))
    first = Sequence(0, list(range(1, 14)) + [99, 98], SamplingParams(max_tokens=1))  # diverges at token 13
    sched.add(first)
    while sched.num_unfinished:
        batch = sched.schedule()
        sched.finish_step(batch, {s.request_id: [7] for (s, _), e in zip(batch.entries, batch.emits()) if e})
    assert [dst for _, dst in copies] == [2]  # a chunk cut back to 12, the last boundary of the prompt
    second = Sequence(1, list(range(1, 30)), SamplingParams(max_tokens=1))  # shares blocks 0..2 (12 tokens)
    sched.add(second)
    batch = sched.schedule()
    assert batch.entries == [(second, 16)] and second.num_computed == 12  # resumes at 12, runs to 28
    assert sched.prefix_hits.stats() == {"prefix_dsa_hit_tokens": 12, "prefix_kda_snapshots_reused": 1,
                                         "prefix_tokens_recomputed": 0}
    assert sched.prefix_hit_tokens == 12


def test_a_tail_without_any_snapshot_starts_from_zero_and_cuts_at_the_dsa_hit():
    copies = []
    bm = BlockManager(num_blocks=32, block_size=4, num_slots=2, num_snapshots=4, enable_prefix_caching=True)
    sched = Scheduler(bm, 2, 32, True, lambda src, dst: copies.append((src, dst)))
    first = Sequence(0, list(range(1, 10)) + [99] * 10, SamplingParams(max_tokens=1))  # diverges at token 9
    sched.add(first)
    while sched.num_unfinished:
        batch = sched.schedule()
        sched.finish_step(batch, {s.request_id: [7] for (s, _), e in zip(batch.entries, batch.emits()) if e})
    assert [dst for _, dst in copies] == [2]  # the snapshot at 16, past the divergence at 9
    second = Sequence(1, list(range(1, 30)), SamplingParams(max_tokens=1))  # blocks 0, 1 cached (8 tokens)
    sched.add(second)
    batch = sched.schedule()
    assert batch.entries == [(second, 8)] and second.num_computed == 0  # the tail [0, 8) ends at the DSA hit
    sched.finish_step(batch, {})
    assert copies[-1] == (second.slot, 3)  # ... where its snapshot is taken
    assert sched.prefix_hits.stats() == {"prefix_dsa_hit_tokens": 8, "prefix_kda_snapshots_reused": 0,
                                         "prefix_tokens_recomputed": 8}
    assert sched.prefix_hit_tokens == 0


# ------------------------------------------------------------------ with a model
def test_a_hit_at_every_split_point_of_a_three_block_prompt_equals_a_fresh_run(grid16_model):
    prompt = tokens(3 * BLOCK, seed=1)
    fresh = fresh_rows(grid16_model, prompt)
    engine = Engine(grid16_model, service())
    for split in range(1, 3 * BLOCK):
        engine.reset()  # an empty prefix cache for each split point
        other = [t for t in tokens(20, seed=100 + split) if t != prompt[split]] or [prompt[split] + 1]
        serve(engine, prompt[:split] + other, max_tokens=1)  # caches the prompt's first `split` tokens
        rows, counts = serve(engine, prompt)
        dsa_hit = split // BLOCK * BLOCK
        assert counts["prefix_dsa_hit_tokens"] == dsa_hit, split
        assert counts["prefix_hit_tokens"] + counts["prefix_tokens_recomputed"] == dsa_hit, split
        assert_same_rows(rows, fresh)
        again, counts = serve(engine, prompt)  # a snapshot was left at the DSA hit
        assert counts["prefix_hit_tokens"] >= dsa_hit, split
        assert_same_rows(again, fresh)
        assert_nothing_held(engine)
    engine.reset()
    assert engine.block_manager.snapshots_held == 0 and engine.block_manager.cached_blocks == 0


def test_rows_cached_but_the_snapshot_evicted_recompute_from_zero(grid16_model):
    prompt = tokens(3 * BLOCK, seed=2)
    engine = Engine(grid16_model, service(snapshots=1))
    serve(engine, prompt, max_tokens=1)  # chunks [0, 32) and [32, 48): the snapshot at 48 evicts the one at 32
    rows, counts = serve(engine, prompt)
    assert counts == {"prefix_hit_tokens": 0, "prefix_dsa_hit_tokens": 32, "prefix_kda_snapshots_reused": 0,
                      "prefix_tokens_recomputed": 32}
    assert_same_rows(rows, fresh_rows(grid16_model, prompt))
    assert_nothing_held(engine)


def test_rows_cached_but_the_snapshot_evicted_recompute_from_the_last_snapshot(grid16_model):
    prompt = tokens(4 * BLOCK, seed=3)
    engine = Engine(grid16_model, service(snapshots=2))
    serve(engine, prompt, max_tokens=1)  # snapshots at 32 and 64
    serve(engine, prompt[:40], max_tokens=1)  # a hit at 32 makes that snapshot the most recently used
    serve(engine, tokens(40, seed=4, low=300, high=400), max_tokens=1)  # its snapshot evicts the one at 64
    longer = prompt + [5, 6, 7]
    rows, counts = serve(engine, longer)
    assert counts == {"prefix_hit_tokens": 32, "prefix_dsa_hit_tokens": 64, "prefix_kda_snapshots_reused": 1,
                      "prefix_tokens_recomputed": 32}
    assert_same_rows(rows, fresh_rows(grid16_model, longer))
    assert_nothing_held(engine)


def test_an_abort_during_the_tail_gives_everything_back(grid16_model):
    prompt = tokens(3 * BLOCK, seed=5)
    engine = Engine(grid16_model, service(chunk=32))
    serve(engine, prompt[:20] + tokens(20, seed=6, low=300, high=400), max_tokens=1)  # caches block 0 only
    waiting = engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.abort(waiting)
    assert_nothing_held(engine)
    running = engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.step()  # the tail [0, 16), cut at the DSA hit
    seq = engine.sequence(running)
    assert seq.num_computed == BLOCK and engine.stats()["prefix_tokens_recomputed"] == BLOCK
    engine.abort(running)
    assert_nothing_held(engine)
    rows, _ = serve(engine, prompt)  # the snapshot the aborted tail left serves the next request
    assert engine.stats()["prefix_hit_tokens"] == BLOCK
    assert_same_rows(rows, fresh_rows(grid16_model, prompt))


@pytest.mark.parametrize("cut_at_dsa_hit", [True, False])
def test_a_shared_system_prompt_hits_from_its_third_request_on(grid16_model, cut_at_dsa_hit):
    system = tokens(40, seed=7)  # its last block boundary is at 32
    engine = Engine(grid16_model, service(chunk=64))
    engine.scheduler.prefix_hits.cut_at_dsa_hit = cut_at_dsa_hit
    hits = [serve(engine, system + tokens(15, seed=10 + i, low=300, high=400), max_tokens=1)[1] for i in range(4)]
    assert [h["prefix_dsa_hit_tokens"] for h in hits] == [0, 32, 32, 32]
    expected = [0, 0, 32, 32] if cut_at_dsa_hit else [0, 0, 0, 0]  # the rule before never hits here
    assert [h["prefix_hit_tokens"] for h in hits] == expected
    metrics = ServerMetrics()
    metrics.observe_engine(engine.stats())
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.exposition().decode())
               for s in f.samples}
    assert samples["latentmoe_prefix_dsa_hit_tokens_total"] == 96
    assert samples["latentmoe_prefix_kda_snapshots_reused_total"] == (2 if cut_at_dsa_hit else 0)
    assert samples["latentmoe_prefix_tokens_recomputed_total"] == (32 if cut_at_dsa_hit else 96)
