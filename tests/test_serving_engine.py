"""The serving engine against model.generate, under chunking, preemption and prefix caching (docs/design.md §6.5)."""
import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.multimodal import ImageTextProcessor
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.planner import plan_cache

LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 65, 100, 127, 150, 200, 255, 300]
IMAGE_PROMPTS = {3, 9, 14}  # these carry an image (its span is cut by most chunk sizes)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def prompts(model):
    """16 prompts of ragged lengths; three hold a 56x56 image (4 placeholders) near their start."""
    g = torch.Generator().manual_seed(1)
    processor = ImageTextProcessor(model.config)
    out = []
    for i, length in enumerate(LENGTHS):
        if i in IMAGE_PROMPTS:
            text = "<image>" + bytes(torch.randint(97, 123, (length,), generator=g).tolist()).decode()
            batch = processor(text, torch.rand(3, 56, 56, generator=g))
            out.append({"input_ids": batch.input_ids, "pixel_values": batch.pixel_values,
                        "image_grids": batch.image_grids})
        else:
            out.append(torch.randint(0, 256, (length,), generator=g).tolist())
    return out


def _reference(model, prompt, new_tokens=NEW_TOKENS):
    if isinstance(prompt, dict):
        ids = prompt["input_ids"]
        out = model.generate(ids, new_tokens, pixel_values=prompt["pixel_values"], image_grids=prompt["image_grids"])
    else:
        ids = torch.tensor([prompt])
        out = model.generate(ids, new_tokens)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(model, prompts):
    return [_reference(model, p) for p in prompts]


def service(chunk=64, block=16, prefix=False, cache_bytes=2_000_000, max_num_seqs=8, max_model_len=512,
            max_batch_size=64, **memory):
    return ServiceConfig.from_dict({
        "model": {"max_model_len": max_model_len},
        "memory": {"cache_bytes": cache_bytes, "block_size": block, "max_num_seqs": max_num_seqs,
                   "prefix_cache": {"enabled": prefix}, **memory},
        "scheduler": {"prefill_chunk_size": chunk, "max_batch_size": max_batch_size}})


def budget_for(blocks, block=16, prefix=False, max_num_seqs=8):
    """cache_bytes that plan exactly `blocks` blocks next to the KDA slots (and snapshots)."""
    plan = plan_cache(ModelConfig.from_preset("tiny"), service(block=block, prefix=prefix, max_num_seqs=max_num_seqs))
    return plan.pool_rows * plan.slot_bytes + blocks * plan.block_bytes


def assert_drained(engine):
    stats = engine.stats()
    assert stats["blocks_used"] == 0 and stats["slots_used"] == 0
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert all(count == 0 for count in engine.block_manager.ref_count)


# (chunk, block, prefix caching, blocks in the pools, prompts, max_model_len). Small chunks run a subset
# (every step is a model forward on a shared CPU): 1 token, both sides of block edges, an image cut by
# the chunk. 40 blocks of 16 hold just over one 512-token sequence and 8 of 16 one 128-token one, so
# those cases force preemption (with chunk 32 a preempted prompt also gets its own blocks back as a hit).
SUBSET = [0, 2, 4, 5, 9, 3]
CASES = [(256, 16, False, 40, None, 512), (64, 64, True, 64, None, 512), (7, 16, True, 64, SUBSET, 128),
         (16, 16, True, 8, SUBSET, 128), (32, 16, True, 8, SUBSET, 128)]


@pytest.mark.parametrize("chunk,block,prefix,blocks,subset,max_len", CASES,
                         ids=["chunk256-block16-preempt", "chunk64-block64-prefix", "chunk7-block16-prefix",
                              "chunk16-block16-prefix-preempt", "chunk32-block16-prefix-preempt"])
def test_greedy_matches_generate_alone(model, prompts, references, chunk, block, prefix, blocks, subset, max_len):
    chosen = range(len(prompts)) if subset is None else subset
    engine = Engine(model, service(chunk=chunk, block=block, prefix=prefix, max_model_len=max_len,
                                   cache_bytes=budget_for(blocks, block, prefix)))
    assert engine.plan.num_blocks == blocks
    outputs = engine.generate([prompts[i] for i in chosen], SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    for i, out in zip(chosen, outputs):
        assert out.error is None, out.error
        assert out.token_ids == references[i], f"prompt {i} ({LENGTHS[i]} tokens)"
        assert out.finish_reason == "length" and out.metrics.generated_tokens == NEW_TOKENS
    if blocks * block < 2 * max_len:
        assert engine.stats()["preemptions"] > 0, "the budget was meant to force preemption"
    assert_drained(engine)


def test_prefix_hit_gives_the_same_logits_and_tokens(model):
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 256, (80,), generator=g).tolist()
    first, second = shared + [5, 6, 7], shared + [9, 10]
    recorded = {}

    def run(prefix):
        engine = Engine(model, service(chunk=32, block=16, prefix=prefix))
        original = engine.runner.run

        def recording_run(batch):
            output = original(batch)
            for i, ((seq, _), emits) in enumerate(zip(batch.entries, batch.emits())):
                if emits and seq.request_id == 1 and len(seq.generated_ids) == 0:
                    recorded[prefix] = output.logits[i].clone()
            return output

        engine.runner.run = recording_run
        tokens = [engine.generate([p], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids
                  for p in (first, second)]
        return engine, tokens

    hit_engine, hit_tokens = run(True)
    miss_engine, miss_tokens = run(False)
    assert hit_engine.stats()["prefix_hit_tokens"] == 80  # 5 full blocks: the chain and the snapshot at 80
    assert miss_engine.stats()["prefix_hit_tokens"] == 0
    assert hit_engine.stats()["prefill_tokens"] < miss_engine.stats()["prefill_tokens"]
    torch.testing.assert_close(recorded[True], recorded[False], rtol=1e-5, atol=1e-5)
    assert hit_tokens == miss_tokens == [_reference(model, p, 4) for p in (first, second)]
    assert_drained(hit_engine)
    assert hit_engine.stats()["cached_blocks"] > 0  # cached blocks stay for later hits, unreferenced


def test_image_prefix_hit_needs_the_same_image(model):
    """Blocks holding image placeholders hash the image's pixels: equal token ids, another image -> no hit."""
    processor = ImageTextProcessor(model.config)
    text = "<image>" + "x" * 40
    a, b = (processor(text, torch.rand(3, 56, 56, generator=torch.Generator().manual_seed(s))) for s in (3, 4))
    engine = Engine(model, service(chunk=64, block=16, prefix=True))
    params = SamplingParams(max_tokens=2)
    for batch in (a, a, b):
        engine.generate([{"input_ids": batch.input_ids, "pixel_values": batch.pixel_values,
                          "image_grids": batch.image_grids}], params, use_tqdm=False)
    assert engine.stats()["prefix_hit_tokens"] == 32  # the second `a` only (47 tokens: 2 full blocks)


def test_sampled_tokens_do_not_depend_on_the_batch_mix(model, prompts):
    params = [SamplingParams(max_tokens=5, temperature=0.9, top_k=40, top_p=0.9, seed=100 + i) for i in range(6)]
    chosen = [prompts[i] for i in (0, 4, 6, 9, 11, 13)]
    alone = []
    for prompt, p in zip(chosen, params):
        engine = Engine(model, service())
        alone.append(engine.generate([prompt], p, use_tqdm=False)[0].token_ids)
    mixed_engine = Engine(model, service(chunk=16, block=16, cache_bytes=budget_for(40)))
    mixed = [o.token_ids for o in mixed_engine.generate(chosen, params, use_tqdm=False)]
    assert mixed == alone
    assert len({tuple(t) for t in alone}) > 1


def test_abort_releases_everything(model, prompts):
    engine = Engine(model, service(chunk=64, max_num_seqs=2))
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in prompts[4:8]]
    for _ in range(3):
        engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 2
    aborted = [engine.abort(ids[0]), engine.abort(ids[3])]  # one running, one waiting
    assert all(o.finished and o.finish_reason == "abort" for o in aborted)
    with pytest.raises(ValueError, match="request_id"):
        engine.abort(ids[0])
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == [ids[1], ids[2]]
    assert_drained(engine)


def test_stream_yields_the_generated_tokens(model, prompts, references):
    engine = Engine(model, service())
    engine.add_request(prompts[5], SamplingParams(max_tokens=3))  # another request shares the steps
    streamed = [o for o in engine.stream(prompts[7], SamplingParams(max_tokens=NEW_TOKENS))]
    assert [t for o in streamed for t in o.new_token_ids] == references[7]
    assert streamed[-1].finished and streamed[-1].token_ids == references[7]
    metrics = streamed[-1].metrics
    assert metrics.ttft > 0 and metrics.e2e >= metrics.ttft and len(metrics.itl) == NEW_TOKENS - 1
