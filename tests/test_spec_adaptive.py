"""Speculation that pays for itself (serving/spec/draft_count.py, docs/design.md §12): k per sequence from its
own acceptance, k = 0 steps (also right after a step that accepted drafts), probes, speculative.max_context,
with the batched MTP drafter and the n-gram one: greedy tokens equal model.generate, everything given back.

The random tiny model is bent into an echo (tests/spec_cases.py: larger embeddings tied to the LM
head, the MTP projection's token half the identity), so drafts of both methods get accepted and rejected.
"""
import pytest
import torch

from spec_cases import echo_model  # noqa: F401

from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.spec.draft_count import DraftCount, best_draft_count
from latentmoe_lab.serving.spec.section import SpeculativeSection

LENGTHS = [3, 9, 17, 30, 41]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(echo_model, prompts):
    return [echo_model.generate(torch.tensor([p]), NEW_TOKENS)[0, len(p):].tolist() for p in prompts]


def _engine(model, method, **speculative):
    return Engine(model, ServiceConfig.from_dict({
        "model": {"max_model_len": 256},
        "memory": {"cache_bytes": 3_000_000, "block_size": 16, "max_num_seqs": 4},
        "scheduler": {"prefill_chunk_size": 16},
        "speculative": {"method": method, "num_speculative_tokens": 3, **speculative}}))


def _assert_drained(engine):
    stats = engine.stats()
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
    assert len(engine.block_manager.free_slots) == engine.block_manager.num_slots
    drafter, count = engine.speculator.drafter, engine.speculator.draft_count
    assert getattr(drafter, "states", {}) == {} and count.acceptance == {} and count.idle == {}
    if hasattr(drafter, "pools"):  # the batched MTP drafter's blocks
        assert drafter.pools.blocks_used == 0


class ZeroAfterAccept(DraftCount):
    """The adaptive rule, except that the step right after a verify step that accepted drafts gets k = 0."""

    def __init__(self, spec):
        super().__init__(spec)
        self.accepted_last, self.zero_after_accept, self.chosen = set(), 0, []

    def observe(self, request_id, drafts, accepted):
        super().observe(request_id, drafts, accepted)
        if accepted:
            self.accepted_last.add(request_id)

    def choose(self, request_id, context):
        k = super().choose(request_id, context)
        if request_id in self.accepted_last:
            self.accepted_last.discard(request_id)
            self.zero_after_accept += 1
            k = 0
        self.chosen.append(k)
        return k


def test_the_draft_count_rule():
    assert best_draft_count([1.0, 1.0, 1.0], 0.25) == 3 and best_draft_count([0.1, 0.9, 0.9], 0.25) == 0
    # E(1) = 0.9: 1.9 / 1.25 = 1.52 beats E(2) = 1.08: 2.08 / 1.5 and E(3) = 1.242: 2.242 / 1.75
    assert best_draft_count([0.9, 0.2, 0.9], 0.25) == 1
    assert best_draft_count([0.9, 0.9, 0.9], 0.25) == 3 and best_draft_count([0.9, 0.9, 0.9], 2.0) == 0
    spec = SpeculativeSection("ngram", 3, adaptive=True, draft_cost=0.25, probe_interval=3, max_context=50)
    count = DraftCount(spec)
    assert count.choose(1, 10) == 3 and count.choose(1, 51) == 0  # a new sequence drafts K; past max_context 0
    for _ in range(5):  # rejected at position 1, five times: a_1 = 0.7 ** 5 = 0.17 -> 1.17 / 1.25 < 1
        count.observe(1, 3, 0)
    assert count.acceptance[1][1:] == [1.0, 1.0]  # positions 2 and 3 were never judged
    assert [count.choose(1, 10) for _ in range(7)] == [0, 0, 1, 0, 0, 1, 0]  # a one-draft probe every 3rd step
    count.observe(1, 1, 1)  # an accepted probe: a_1 = 0.17 + 0.3 * 0.83 = 0.42, k = 3 pays again
    assert count.choose(1, 10) == 3
    assert DraftCount(SpeculativeSection("mtp", 2)).choose(7, 10 ** 6) == 2  # not adaptive, no limit: always K


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_greedy_equals_generate_with_adaptive_k_and_k0_right_after_accepting(echo_model, prompts, references, method):
    engine = _engine(echo_model, method, adaptive=True, draft_cost=0.5, probe_interval=2)
    count = engine.speculator.draft_count = ZeroAfterAccept(engine.config.speculative)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    for out, reference in zip(outputs, references):
        assert out.error is None and out.token_ids == reference
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert count.zero_after_accept > 0 and {0, 1, 3} <= set(count.chosen), count.chosen
    _assert_drained(engine)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_max_context_turns_speculation_off_past_it(echo_model, prompts, references, method):
    engine = _engine(echo_model, method, max_context=24)
    proposed = []
    propose_batch = engine.speculator.drafter.propose_batch

    def recording(requests):
        proposed.extend(len(draft_input.tokens) for _, draft_input, _ in requests)
        return propose_batch(requests)
    engine.speculator.drafter.propose_batch = recording
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in prompts]
    engine.step()
    engine.abort(ids[2])  # an abort in the middle gives everything back as well
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    for i, (request_id, reference) in enumerate(zip(ids, references)):
        assert i == 2 or done[request_id] == reference
    assert proposed and max(proposed) <= 24 and engine.stats()["spec_draft_tokens"] > 0
    _assert_drained(engine)
