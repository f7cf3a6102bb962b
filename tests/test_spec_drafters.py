"""Drafters of speculative decoding (serving/spec/): n-gram lookup and the MTP head against brute-force twins."""
import random

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.serving.spec import DraftInput, MTPDrafter, NgramDrafter, ngram_proposal


def _brute_ngram(tokens, k, lookup_min, lookup_max):
    """Every n from the longest, every earlier start from the latest: the first equal window proposes."""
    for n in range(lookup_max, lookup_min - 1, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if n <= len(tokens) - 1 and tokens[i:i + n] == tokens[len(tokens) - n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposal_equals_the_brute_force_twin_on_random_token_lists():
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        lookup_min = rng.randrange(1, 4)
        lookup_max = lookup_min + rng.randrange(0, 4)
        k = rng.randrange(1, 9)
        expected = _brute_ngram(tokens, k, lookup_min, lookup_max)
        assert ngram_proposal(tokens, k, lookup_min, lookup_max) == expected, (tokens, k, lookup_min, lookup_max)
        found += bool(expected)
    assert 1000 < found < 2900  # both outcomes are exercised


def test_ngram_examples_and_bad_settings():
    drafter = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
    # the longest suffix wins over a later shorter match; among equal lengths the most recent one
    assert drafter.propose(0, DraftInput([7, 1, 2, 9, 5, 2, 4, 1, 2]), 3) == [9, 5, 2]
    assert drafter.propose(0, DraftInput([3, 8, 3, 6, 3]), 2) == [6, 3]
    assert drafter.propose(0, DraftInput([1, 2, 3]), 4) == [] and drafter.propose(0, DraftInput([5]), 2) == []
    for kwargs, key in ((dict(prompt_lookup_min=0, prompt_lookup_max=2), "prompt_lookup_min"),
                        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
                        (dict(prompt_lookup_min=1, prompt_lookup_max=True), "prompt_lookup_max")):
        with pytest.raises(ValueError, match=key):
            NgramDrafter(**kwargs)


def _target_hidden(model, tokens):
    """The target's last hidden state (before its final norm) at every position: [T, d]."""
    x = model.embed_tokens(torch.tensor([tokens]))
    for block in model.layers:
        x = block(x)
    return x[0]


def _reference_mtp(model, tokens, hidden, k):
    """From scratch: depth j over every position 0..t reads the depth below and y[s + j] (tokens, then drafts);
    past the last depth, it runs again over t + 1, t + 2, ... with its own outputs as the input hidden."""
    depths, t, y, drafts = model.mtp.depths, len(tokens) - 2, list(tokens), []
    pick = lambda depth, row: int(model.lm_head(depth.norm(row)).argmax(-1)[0])  # noqa: E731
    below = hidden[None, :t + 1]
    for j, depth in enumerate(depths[:k], start=1):
        inputs = below
        below = depth(inputs, model.embed_tokens(torch.tensor([y[j:t + 1 + j]])))
        drafts.append(pick(depth, below[:, t]))
        y.append(drafts[-1])
    outputs, last = [below[:, t]], len(depths)
    while len(drafts) < k:
        rows = torch.cat([inputs, torch.stack(outputs, dim=1)], dim=1)
        n = rows.shape[1]  # positions 0 .. t + len(outputs)
        out = depths[-1](rows, model.embed_tokens(torch.tensor([y[last:n + last]])))
        drafts.append(pick(depths[-1], out[:, n - 1]))
        y.append(drafts[-1])
        outputs.append(out[:, n - 1])
    return drafts


@pytest.mark.parametrize("mtp_depth", [1, 2])
def test_mtp_drafter_equals_a_from_scratch_twin_as_requests_grow(mtp_depth):
    torch.manual_seed(mtp_depth)
    config = ModelConfig.from_preset("tiny").replace(mtp_depth=mtp_depth, vision=None)
    model = LatentMoEForCausalLM(config).double().eval()
    rng = random.Random(mtp_depth)
    sequences = {rid: [rng.randrange(config.vocab_size) for _ in range(24)] for rid in (3, 8)}
    with torch.no_grad():
        hidden = {rid: _target_hidden(model, tokens) for rid, tokens in sequences.items()}
        drafter, seen = MTPDrafter(model), {3: 1, 8: 1}
        for length, k in ((2, 3), (3, 1), (6, 5), (7, 2), (11, 4), (12, 1), (17, 5), (24, 3)):
            for rid, tokens in sequences.items():  # two requests interleaved, each with its own state
                new_rows = hidden[rid][seen[rid] - 1:length - 1]
                got = drafter.propose(rid, DraftInput(tokens[:length], new_rows), k)
                seen[rid] = length
                assert got == _reference_mtp(model, tokens[:length], hidden[rid][:length - 1], k), (rid, length, k)
                assert all(cache.length == max(0, length - j) for j, cache in
                           enumerate(drafter.states[rid].caches, start=1))  # no draft row left behind
    drafter.release(3)
    assert list(drafter.states) == [8]


def test_mtp_drafter_refuses_a_model_without_a_head_and_bad_hidden_rows():
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(vision=None))
    with pytest.raises(ValueError, match="speculative.method"):
        MTPDrafter(model)
    with_head = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None))
    drafter = MTPDrafter(with_head)
    with pytest.raises(ValueError, match="draft_input.hidden"):
        drafter.propose(0, DraftInput([1, 2, 3], torch.zeros(1, 64)), 2)  # 2 positions were run
    with pytest.raises(ValueError, match="draft_input.hidden"):
        drafter.propose(0, DraftInput([1, 2, 3], None), 2)
    assert drafter.states == {}
    with pytest.raises(ValueError, match="length"):
        DSALayerCache().truncate(1)
