"""The batched MTP drafter (serving/spec/mtp_batched.py) against its serial twin (mtp_drafter.py): the same
drafts for ragged batches of requests with different histories, k = 0 .. 3 (0: rows committed, no draft)."""
import random

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving.spec import DraftInput, MTPDrafter
from latentmoe_lab.serving.spec.mtp_batched import BatchedMTPDrafter


def _target_hidden(model, tokens):
    x = model.embed_tokens(torch.tensor([tokens]))
    for block in model.layers:
        x = block(x)
    return x[0]


def _assert_same_rows(batched, serial, rid):
    """The committed rows agree: each depth's DSA keys in the pool (through the request's block table) with
    the serial cache's, and the h rows the batched drafter still holds with the serial drafter's."""
    state, twin = batched.states[rid], serial.states[rid]
    table, size = torch.tensor(batched.pools.tables[rid]), batched.pools.block_size
    for depth, (pool, cache) in enumerate(zip(batched.pools.pools, twin.caches), start=1):
        count = state.committed[depth]
        assert count == cache.length
        if count == 0:
            continue
        position = torch.arange(count)
        keys, _ = pool.read(table[position // size] * size + position % size)
        torch.testing.assert_close(keys, cache.absorbed_keys[0], rtol=0, atol=1e-10)
    for depth, tail in enumerate(state.tails):
        torch.testing.assert_close(tail, twin.hidden[depth][0, state.committed[depth + 1]:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mtp_depth", [1, 2])
def test_batched_drafts_equal_the_serial_drafter_on_ragged_batches(mtp_depth):
    torch.manual_seed(10 + mtp_depth)
    config = ModelConfig.from_preset("tiny").replace(mtp_depth=mtp_depth, vision=None)
    model = LatentMoEForCausalLM(config).double().eval()
    rng = random.Random(mtp_depth)
    tokens = {rid: [rng.randrange(config.vocab_size) for _ in range(40)] for rid in (2, 5, 7, 11)}
    with torch.no_grad():
        hidden = {rid: _target_hidden(model, t) for rid, t in tokens.items()}
    # a small block size so that requests cross blocks and the pools grow
    serial, batched = MTPDrafter(model), BatchedMTPDrafter(model, block_size=4)
    length, seen, drafted = {rid: rng.randrange(2, 9) for rid in tokens}, {rid: 1 for rid in tokens}, 0
    for step in range(9):
        # a ragged step: some requests sit out, some commit rows with k = 0, the others draft 1 .. 3
        chosen = [rid for rid in tokens if rng.random() < 0.8 and length[rid] <= 40]
        requests = []
        for rid in chosen:
            k = rng.choice([0, 1, 2, 3])
            rows = hidden[rid][seen[rid] - 1:length[rid] - 1]
            requests.append((rid, DraftInput(tokens[rid][:length[rid]], rows), k))
            seen[rid] = length[rid]
        got = batched.propose_batch(requests)
        for (rid, draft_input, k), drafts in zip(requests, got):
            assert drafts == serial.propose(rid, draft_input, k), (step, rid, k)
            assert len(drafts) == k
            drafted += k
        for rid in chosen:
            _assert_same_rows(batched, serial, rid)
            length[rid] += rng.randrange(1, 5)  # accepted drafts + 1
        if step == 5:  # a finished request gives its blocks back; a new one under the same id starts over
            batched.release(5), serial.release(5)
            seen[5] = 1
    assert drafted > 20
    for rid in list(batched.states):
        batched.release(rid)
    assert batched.pools.blocks_used == 0 and batched.pools.num_blocks > 16  # grown, all back


def test_batched_drafter_refuses_bad_requests():
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None))
    drafter = BatchedMTPDrafter(model)
    with pytest.raises(ValueError, match="k"):
        drafter.propose_batch([(0, DraftInput([1, 2], torch.zeros(1, 64)), -1)])
    with pytest.raises(ValueError, match="draft_input.hidden"):
        drafter.propose_batch([(0, DraftInput([1, 2, 3], torch.zeros(1, 64)), 2)])
    with pytest.raises(ValueError, match="appears twice"):
        drafter.propose_batch([(0, DraftInput([1, 2], torch.zeros(1, 64)), 1)] * 2)
    with pytest.raises(ValueError, match="speculative.method"):
        BatchedMTPDrafter(LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(vision=None)))
    assert drafter.states == {} and drafter.pools.blocks_used == 0
