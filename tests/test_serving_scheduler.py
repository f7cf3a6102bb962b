"""Block manager and scheduler rules, without a model (docs/design.md §6.3, §6.5); the image-feature policy with one."""
import pytest
import torch

from latentmoe_lab.multimodal import ImageTextProcessor
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.scheduler import Scheduler
from latentmoe_lab.serving.sequence import Sequence, Status


def test_refcounts_free_lists_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2, num_slots=2, num_snapshots=1, enable_prefix_caching=True)
    a, b = bm.allocate_blocks(2), bm.allocate_blocks(2)
    assert bm.blocks_used == 4 and bm.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="allocate_blocks"):
        bm.allocate_blocks(1)
    bm.register_block(b"h0", a[0])
    bm.register_block(b"h1", b[0])
    bm.release_blocks(a)
    bm.release_blocks(b)
    assert bm.blocks_used == 0 and bm.num_free_blocks == 4 and bm.cached_blocks == 2
    with pytest.raises(RuntimeError, match="not referenced"):
        bm.release_blocks([a[1]])
    fresh = bm.allocate_blocks(3)  # two plain free blocks first, then the least recently released cached one
    assert set(fresh[:2]) == {a[1], b[1]} and fresh[2] == a[0]
    assert bm.cached_blocks == 1 and b"h0" not in bm.block_of_hash


def test_a_hit_needs_a_snapshot_at_its_end():
    bm = BlockManager(num_blocks=6, block_size=4, num_slots=1, num_snapshots=2, enable_prefix_caching=True)
    blocks = bm.allocate_blocks(3)
    for i, block in enumerate(blocks):
        bm.register_block(f"h{i}".encode(), block)
    assert bm.match_prefix([b"h0", b"h1", b"h2"]) == ([], None)  # DSA blocks alone cannot resume KDA
    row = bm.snapshot_row_for(b"h1")
    assert row == 1  # snapshot rows follow the running slots
    assert bm.snapshot_row_for(b"h1") is None  # one snapshot per prefix is enough
    hit, snapshot = bm.match_prefix([b"h0", b"h1", b"h2", b"h3"])
    assert hit == blocks[:2] and snapshot == row  # the longest chain whose last block has a snapshot
    assert bm.ref_count[blocks[0]] == 2 and bm.ref_count[blocks[2]] == 1
    bm.release_blocks(hit)
    bm.release_blocks(blocks)
    assert bm.blocks_used == 0
    # snapshots are evicted least recently used first; evicting a block drops its snapshot too
    bm.snapshot_row_for(b"h0")
    bm.snapshot_row_for(b"h2")  # no free row: h1's (used by the hit above, but older than h0's) goes
    assert set(bm.snapshot_of_hash) == {b"h0", b"h2"}
    bm.allocate_blocks(6)
    assert bm.snapshots_held == 0 and bm.cached_blocks == 0 and len(bm.free_snapshot_rows) == 2


def test_slots_are_handed_out_and_returned():
    bm = BlockManager(num_blocks=1, block_size=1, num_slots=2)
    first, second = bm.acquire_slot(), bm.acquire_slot()
    assert {first, second} == {0, 1} and bm.acquire_slot() is None and bm.slots_used == 2
    bm.release_slot(first)
    with pytest.raises(RuntimeError, match="release_slot"):
        bm.release_slot(first)
    assert bm.slots_used == 1


def make_scheduler(num_blocks=64, block_size=4, slots=4, budget=16, chunked=True, prefix=False):
    copies = []
    bm = BlockManager(num_blocks, block_size, slots, slots if prefix else 0, prefix)
    return Scheduler(bm, slots, budget, chunked, lambda src, dst: copies.append((src, dst))), copies


def add(scheduler, request_id, length, max_tokens=4):
    seq = Sequence(request_id, list(range(1, length + 1)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(seq)
    return seq


def finish(scheduler, batch, token=7):
    scheduler.finish_step(batch, {seq.request_id: [token] for (seq, _), e in zip(batch.entries, batch.emits()) if e})


def test_decodes_first_then_chunks_within_the_budget():
    sched, _ = make_scheduler(budget=16)
    short = [add(sched, i, 2) for i in range(3)]
    finish(sched, sched.schedule())  # three 2-token prompts prefilled, each sampled a token
    long = add(sched, 3, 40)
    batch = sched.schedule()
    assert [(seq.request_id, n) for seq, n in batch.entries] == [(0, 1), (1, 1), (2, 1), (3, 13)]
    assert batch.num_tokens == 16 and batch.emits() == [True, True, True, False]
    finish(sched, batch)
    assert long.num_computed == 13 and long.status is Status.RUNNING and all(s.num_tokens == 4 for s in short)


def test_prefix_caching_ends_chunks_on_block_boundaries_and_snapshots_there():
    sched, copies = make_scheduler(budget=10, block_size=4, prefix=True)
    seq = add(sched, 0, 23)
    lengths = []
    while seq.in_prefill or not seq.generated_ids:
        batch = sched.schedule()
        lengths.append(batch.entries[0][1])
        finish(sched, batch)
    assert lengths == [8, 8, 4, 3]  # 10-token budget cut back to boundaries 8, 16, 20; the tail alone
    assert [dst for _, dst in copies] == [4, 5, 6]  # a snapshot at each aligned chunk end (rows after slots)
    assert sched.blocks.cached_blocks == 5


def test_preemption_takes_the_newest_and_requeues_it_whole():
    sched, _ = make_scheduler(num_blocks=6, block_size=4, budget=32)
    old, new = add(sched, 0, 10, max_tokens=20), add(sched, 1, 10, max_tokens=20)
    finish(sched, sched.schedule())  # both prefilled: 3 blocks each, all 6 used; 2 decodes later both need a 4th
    while not sched.waiting:
        finish(sched, sched.schedule())
    assert sched.num_preemptions == 1 and sched.waiting[0] is new and new.status is Status.WAITING
    assert new.num_computed == 0 and new.block_table == [] and new.slot is None
    assert new.token_ids[:10] == list(range(1, 11)) and len(new.generated_ids) == 3  # prompt + generated kept
    assert old.status is Status.RUNNING and old.num_tokens == 14 and len(old.block_table) == 4


def test_whole_prompt_prefill_without_chunking():
    sched, _ = make_scheduler(budget=8, chunked=False)
    add(sched, 0, 20)
    add(sched, 1, 3)
    batch = sched.schedule()  # the first prefill of a step may overrun the budget; the next waits
    assert [(seq.request_id, n) for seq, n in batch.entries] == [(0, 20)]


def test_vision_features_are_computed_once_per_request(model):
    """Policy "features once": chunks of 3 cut the 6-token image span; the tower still runs once per request."""
    processor = ImageTextProcessor(model.config)
    batch = processor("ab<image>what is it?", torch.rand(3, 56, 56, generator=torch.Generator().manual_seed(0)))
    prompt = {"input_ids": batch.input_ids, "pixel_values": batch.pixel_values, "image_grids": batch.image_grids}
    reference = model.generate(**prompt, max_new_tokens=4)[0, batch.input_ids.shape[1]:].tolist()
    calls = []
    original = model.encode_images

    def counting_encode(pixel_values, image_grids):
        calls.append(image_grids.shape[0])
        return original(pixel_values, image_grids)

    model.encode_images = counting_encode
    try:
        engine = Engine(model, ServiceConfig.from_dict({
            "model": {"max_model_len": 64},
            "memory": {"cache_bytes": 200_000, "block_size": 4, "max_num_seqs": 2},
            "scheduler": {"prefill_chunk_size": 3}}))
        outputs = engine.generate([prompt, prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        del model.encode_images
    assert [o.token_ids for o in outputs] == [reference, reference]
    assert calls == [1, 1]  # one tower call per request, none per chunk
