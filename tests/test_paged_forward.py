"""The paged serving forward (ForwardBatch + PagedPools) against the contiguous HybridCache twin
(docs/design.md §6.3-6.4).

A minimal stand-in for the scheduler drives it: `run_paged` feeds sequences step by step, mixing prefill
chunks and decodes in one batch, with blocks taken from a shuffled free list (block tables are not
contiguous) and slots not in sequence order; `run_contiguous` feeds each sequence alone through a
HybridCache in the same chunks. Both give the logits at each (step, sequence) chunk end.
Tiny preset, fp32; prompts longer than the indexer's top-k (32) so the sparse selection is active.
"""
from __future__ import annotations

import random

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.config import KDA
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.multimodal import ImageTextProcessor
from latentmoe_lab.paged_pools import PagedPools

TOL = dict(atol=1e-5, rtol=1e-5)


def _sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=generator).tolist() for n in lengths]  # text ids only


def mixed_schedule(prompt_lens: list[int], total_lens: list[int], chunk: int, start_steps: list[int]):
    """Steps of (seq, n_new): a sequence starts at its start step, prefills in chunks, then decodes one by one."""
    done = [0] * len(prompt_lens)
    steps, step = [], 0
    while any(d < t for d, t in zip(done, total_lens)):
        entries = []
        for i, (prompt, total) in enumerate(zip(prompt_lens, total_lens)):
            if step < start_steps[i] or done[i] >= total:
                continue
            n = min(chunk, prompt - done[i]) if done[i] < prompt else 1
            entries.append((i, n))
            done[i] += n
        steps.append(entries)
        step += 1
    return steps


def run_paged(model, sequences: list[list[int]], schedule, block_size: int, num_blocks: int = 64,
              shuffle_seed: int | None = 0, pools: PagedPools | None = None, features=None):
    """-> (logits {(step, seq): [vocab]}, pools, block tables, slots). features[i]: that sequence's image features."""
    pools = pools or PagedPools(model.config, num_blocks, block_size, num_slots=len(sequences) + 1)
    free = list(range(pools.num_blocks))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(free)
    tables = [[] for _ in sequences]
    slots = list(range(1, len(sequences) + 1))  # slot 0 stays unused: slots need not match sequence order
    done = [0] * len(sequences)
    out = {}
    for step, entries in enumerate(schedule):
        chunks, features_here = [], []
        for seq, n in entries:
            while len(tables[seq]) * block_size < done[seq] + n:
                tables[seq].append(free.pop())
            chunks.append(sequences[seq][done[seq]:done[seq] + n])
            if features is not None and features[seq] is not None:
                ids = torch.tensor(sequences[seq])
                placeholders = ids == model.config.vision.image_token_id
                before = int(placeholders[:done[seq]].sum())
                features_here.append(features[seq][before:before + int(placeholders[done[seq]:done[seq] + n].sum())])
        batch = ForwardBatch.from_sequences(
            chunks, [done[seq] for seq, _ in entries], [tables[seq] for seq, _ in entries],
            [slots[seq] for seq, _ in entries], block_size,
            image_features=torch.cat(features_here) if features_here else None)
        logits = model(batch.input_ids, batch=batch, pools=pools).logits
        for row, (seq, n) in enumerate(entries):
            out[(step, seq)] = logits[row]
            done[seq] += n
    return out, pools, tables, slots


def run_contiguous(model, sequences: list[list[int]], schedule):
    """The reference: each sequence alone through a HybridCache, in the same chunks."""
    caches = [model.new_cache() for _ in sequences]
    done = [0] * len(sequences)
    out = {}
    for step, entries in enumerate(schedule):
        for seq, n in entries:
            ids = torch.tensor([sequences[seq][done[seq]:done[seq] + n]])
            out[(step, seq)] = model(ids, cache=caches[seq]).logits[0, -1]
            done[seq] += n
    return out, caches


def _assert_same(paged: dict, reference: dict) -> None:
    assert paged.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(paged[key], reference[key], **TOL, msg=lambda m: f"(step, seq) {key}: {m}")


# Prompts 1 .. 77 tokens (one shorter than a block, several longer than top-k = 32, one across a 64-block),
# then 4 decodes each, starting at different steps so prefill chunks and decodes share steps. Chunk 1 (a
# step per token) drops the longest prompt to keep the test fast.
PROMPTS, NEW_TOKENS, STARTS = [1, 9, 40, 77], 4, [0, 2, 1, 0]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
@torch.no_grad()
def test_paged_equals_contiguous_on_ragged_mixed_steps(model, chunk, block_size):
    prompts = PROMPTS[:3] if chunk == 1 else PROMPTS
    sequences = _sequences([p + NEW_TOKENS for p in prompts])
    schedule = mixed_schedule(prompts, [len(s) for s in sequences], chunk, STARTS)
    assert any(len({n > 1 for _, n in step}) == 2 for step in schedule) or chunk == 1  # mixed prefill + decode
    paged, _, tables, _ = run_paged(model, sequences, schedule, block_size)
    reference, _ = run_contiguous(model, sequences, schedule)
    _assert_same(paged, reference)
    flat = [b for table in tables for b in table]
    assert flat != sorted(flat)  # the shuffled free list really scattered the blocks


@torch.no_grad()
def test_block_placement_does_not_change_results(model):
    sequences = _sequences([70, 33, 5])
    schedule = mixed_schedule([60, 30, 5], [70, 33, 5], 16, [0, 0, 1])
    in_order, *_ = run_paged(model, sequences, schedule, 16, shuffle_seed=None)
    for seed in (1, 2):
        scattered, *_ = run_paged(model, sequences, schedule, 16, shuffle_seed=seed)
        for key in in_order:
            torch.testing.assert_close(scattered[key], in_order[key], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
@torch.no_grad()
def test_kda_slot_after_any_chunk_schedule_equals_one_pass(model, chunk):
    prompts = [40, 3, 70]
    sequences = _sequences(prompts, seed=1)
    _, pools, _, slots = run_paged(model, sequences, mixed_schedule(prompts, prompts, chunk, [0, 1, 0]), 16)
    for seq, ids in enumerate(sequences):
        cache = model.new_cache()
        model(torch.tensor([ids]), cache=cache)  # one pass over the whole prompt
        for layer, kind in enumerate(model.config.layer_types):
            if kind == KDA:
                pool = pools.layer(layer)
                torch.testing.assert_close(pool.state[slots[seq]], cache[layer].recurrent_state[0], **TOL)
                torch.testing.assert_close(pool.conv[slots[seq]], cache[layer].conv_state[0], **TOL)


@torch.no_grad()
def test_stale_slot_contents_are_ignored_for_a_new_sequence(model):
    sequences = _sequences([20, 2])
    schedule = mixed_schedule([20, 2], [20, 2], 7, [0, 0])
    pools = PagedPools(model.config, 8, 16, num_slots=3)
    for pool in pools.layers:  # garbage from an earlier owner of the slots and blocks
        for tensor in vars(pool).values():
            if isinstance(tensor, torch.Tensor):
                tensor.normal_()
    paged, *_ = run_paged(model, sequences, schedule, 16, pools=pools)
    reference, _ = run_contiguous(model, sequences, schedule)
    _assert_same(paged, reference)


@torch.no_grad()
def test_copied_slot_continues_like_the_original(model):
    """A KDA snapshot (copy_slot) plus the same blocks continues exactly as the sequence it was taken from."""
    ids = _sequences([45])[0]
    pools = PagedPools(model.config, 8, 16, num_slots=4)
    blocks = [5, 2, 7, 0]
    prefill = ForwardBatch.from_sequences([ids[:40]], [0], [blocks], [1], 16)
    model(prefill.input_ids, batch=prefill, pools=pools)
    pools.copy_slot(1, 3)
    pools.zero_slot(1)  # the original slot is gone; only the snapshot holds the state
    step = ForwardBatch.from_sequences([ids[40:45]], [40], [blocks], [3], 16)
    logits = model(step.input_ids, batch=step, pools=pools).logits[0]
    torch.testing.assert_close(logits, model(torch.tensor([ids])).logits[0, -1], **TOL)


@pytest.mark.parametrize("chunk", [3, 7])
@torch.no_grad()
def test_image_prompt_in_chunks_splitting_the_image_equals_generate_prefill(model, chunk):
    processor = ImageTextProcessor(model.config)
    image = torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(0))
    prompt = processor("ab<image>What colour is it?", image)
    ids = prompt.input_ids[0].tolist()
    span = [i for i, t in enumerate(ids) if t == model.config.vision.image_token_id]
    assert any(span[0] < edge <= span[-1] for edge in range(0, len(ids), chunk))  # a chunk edge cuts the image

    features = model.encode_images(prompt.pixel_values, prompt.image_grids)
    assert features.shape == (len(span), model.config.hidden_size)
    text = _sequences([30])[0]
    sequences = [ids, text]
    schedule = mixed_schedule([len(ids), len(text)], [len(ids), len(text)], chunk, [0, 1])
    paged, *_ = run_paged(model, sequences, schedule, 16, features=[features, None])
    last_step = max(step for step, seq in paged if seq == 0)

    expected = model(**prompt.model_inputs(), cache=model.new_cache()).logits[0, -1]  # generate's prefill
    torch.testing.assert_close(paged[(last_step, 0)], expected, **TOL)
    first_token = model.generate(**prompt.model_inputs(), max_new_tokens=1)[0, -1]
    assert int(paged[(last_step, 0)].argmax()) == int(first_token)
    reference, _ = run_contiguous(model, [text], [[(0, n) for seq, n in step if seq == 1] for step in schedule])
    text_rows = {key: value for key, value in paged.items() if key[1] == 1}
    torch.testing.assert_close(torch.stack(list(text_rows.values())), torch.stack(list(reference.values())), **TOL)


@torch.no_grad()
def test_image_mask_keeps_a_generated_placeholder_id_as_text(model):
    """A decode token that happens to be the image id keeps its embedding when image_mask leaves it out."""
    processor = ImageTextProcessor(model.config)
    prompt = processor("<image>hi", torch.rand(3, 28, 28, generator=torch.Generator().manual_seed(1)))
    ids = prompt.input_ids[0].tolist()
    features = model.encode_images(prompt.pixel_values, prompt.image_grids)
    image_id = model.config.vision.image_token_id
    history = _sequences([6])[0] + [image_id]
    pools = PagedPools(model.config, 8, 16, num_slots=2)
    warm = ForwardBatch.from_sequences([history[:-1]], [0], [[3]], [1], 16)
    model(warm.input_ids, batch=warm, pools=pools)
    mask = torch.tensor([t == image_id for t in ids] + [False])
    batch = ForwardBatch.from_sequences([ids, history[-1:]], [0, 6], [[0], [3]], [0, 1], 16,
                                        image_features=features, image_mask=mask)
    logits = model(batch.input_ids, batch=batch, pools=pools).logits
    torch.testing.assert_close(logits[0], model(**prompt.model_inputs()).logits[0, -1], **TOL)
    torch.testing.assert_close(logits[1], model(torch.tensor([history])).logits[0, -1], **TOL)
    unmasked = ForwardBatch.from_sequences([ids, history[-1:]], [0, 6], [[0], [3]], [0, 1], 16,
                                           image_features=features)
    with pytest.raises(ValueError, match="image_features: has 1 rows for 2|image_features: has"):
        model(unmasked.input_ids, batch=unmasked, pools=pools)


def test_logits_shape_and_finite_flags(model):
    pools = PagedPools(model.config, 4, 16, num_slots=2)
    batch = ForwardBatch.from_sequences([[1, 2, 3], [4]], [0, 0], [[0], [1]], [0, 1], 16)
    with torch.no_grad():
        out = model(batch.input_ids, batch=batch, pools=pools)
    assert out.logits.shape == (2, model.config.vocab_size) and out.logits.dtype == torch.float32
    assert out.finite.shape == (model.config.num_layers + 2,) and bool(out.finite.all())


def test_decode_groups_cover_every_decode_and_bound_the_padding():
    from latentmoe_lab.layers.dsa_paged import decode_groups
    contexts = [16000, 5, 6, 300, 7, 280, 0]
    decodes = [0, 1, 2, 3, 4, 5, 6]
    groups = decode_groups(decodes, contexts)
    assert sorted(s for g in groups for s in g) == decodes
    for group in groups:
        keys = [contexts[s] + 1 for s in group]
        assert len(group) * max(keys) <= 2.0 * sum(keys)
    assert len(groups) > 1  # the long context is not padded onto every short one


@torch.no_grad()
def test_bf16_model_with_bf16_pools_matches_the_contiguous_path():
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).to(torch.bfloat16).eval()
    sequences = _sequences([45, 3, 20], seed=2)
    schedule = mixed_schedule([40, 3, 12], [45, 3, 20], 16, [0, 1, 0])
    pools = PagedPools(model.config, 16, 16, num_slots=4, dtype=torch.bfloat16)
    paged, *_ = run_paged(model, sequences, schedule, 16, pools=pools)
    reference, _ = run_contiguous(model, sequences, schedule)
    for key in reference:  # bf16 rounding of the same ops in the same order: a few ulps at most
        torch.testing.assert_close(paged[key], reference[key], atol=2e-3, rtol=1e-2)
