"""Speculative decoding in the engine (docs/design.md §12): exact greedy outputs, KDA slot selection, no
prefix-cache poisoning, the sampling rule's distribution, and every slot and block given back.

The random tiny model rarely agrees with an n-gram or an untrained MTP draft, so besides those drafters an
`Oracle` proposes the true greedy continuation with a wrong tail whose length cycles: every accepted count
0 .. K occurs, and every step has rejections to roll back.
"""
import pytest
import torch
from scipy.stats import chi2_contingency

from latentmoe_lab import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.paged_pools import KDAPool, PagedPools
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.planner import plan_cache
from latentmoe_lab.serving.spec.drafters import Drafter
from latentmoe_lab.serving.spec.verify import rejection_step

LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 65, 100, 127, 150, 200, 255, 300]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None)).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(model, prompts):
    """prompt + its greedy continuation of model.generate, per prompt."""
    return [model.generate(torch.tensor([p]), NEW_TOKENS + 8)[0].tolist() for p in prompts]


class Oracle(Drafter):
    """Proposes the reference continuation, right for `calls % (k + 1)` tokens, then wrong."""

    name = "oracle"

    def __init__(self, references):
        self.references, self.calls, self.released = references, 0, set()

    def propose(self, request_id, draft_input, k):
        tokens = list(draft_input.tokens)
        self.calls += 1
        for reference in self.references:
            if reference[:len(tokens)] == tokens:
                good = reference[len(tokens):len(tokens) + k]
                right = self.calls % (k + 1)
                return good[:right] + [(t + 1) % 256 for t in good[right:]]
        return [tokens[-1]] * k

    def release(self, request_id):
        self.released.add(request_id)


class RequestOracle(Oracle):
    """The oracle with a cut set by the request's own length: its drafts depend on its tokens alone, as the
    n-gram drafter's do, so a recompute proposes them again."""

    def propose(self, request_id, draft_input, k):
        self.calls = len(draft_input.tokens) - 1
        return super().propose(request_id, draft_input, k)


def service(method="ngram", k=3, chunk=64, prefix=True, cache_bytes=3_000_000, max_num_seqs=4, max_model_len=512,
            batch_invariant=False, parallel=None, snapshot_slots=None, **memory):
    spec = None if method is None else {"method": "ngram" if method == "oracle" else method,
                                        "num_speculative_tokens": k}
    return ServiceConfig.from_dict({
        "model": {"max_model_len": max_model_len},
        "memory": {"cache_bytes": cache_bytes, "block_size": 16, "max_num_seqs": max_num_seqs,
                   "prefix_cache": {"enabled": prefix, "snapshot_slots": snapshot_slots}, **memory},
        "scheduler": {"prefill_chunk_size": chunk, "batch_invariant": batch_invariant}, "speculative": spec,
        "parallel": parallel or {}})


def engine_for(model, references, method, **kw):
    engine = Engine(model, service(method, **kw))
    if method == "oracle":
        engine.speculator.drafter = Oracle(references)
    return engine


def assert_drained(engine):
    stats = engine.stats()
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
    assert all(count == 0 for count in engine.block_manager.ref_count)
    assert len(engine.block_manager.free_slots) == engine.block_manager.num_slots  # spec slots included


SUBSET = [0, 3, 5, 8, 10]
# (drafter, K, chunk, blocks of 16 tokens or None for plenty, prompts): 24 blocks hold one 320-token
# sequence and a bit, so the 16 prompts preempt
CASES = [("oracle", 3, 64, None, None), ("oracle", 5, 7, None, SUBSET), ("oracle", 1, 64, 24, None),
         ("ngram", 3, 7, None, SUBSET), ("mtp", 5, 64, 24, None), ("mtp", 1, 64, None, SUBSET)]


@pytest.mark.parametrize("method,k,chunk,blocks,subset", CASES,
                         ids=["oracle-K3-chunk64", "oracle-K5-chunk7", "oracle-K1-preempt", "ngram-K3-chunk7",
                              "mtp-K5-preempt", "mtp-K1"])
def test_greedy_with_speculation_equals_generate(model, prompts, references, method, k, chunk, blocks, subset):
    chosen = range(len(prompts)) if subset is None else subset
    cache_bytes = 3_000_000
    if blocks is not None:
        plan = plan_cache(model.config, service(method, k=k, max_model_len=320))
        cache_bytes = plan.pool_rows * plan.slot_bytes + blocks * plan.block_bytes
    engine = engine_for(model, references, method, k=k, chunk=chunk, cache_bytes=cache_bytes, max_model_len=320)
    assert engine.plan.num_slots == 4 * (k + 1) and (blocks is None or engine.plan.num_blocks == blocks)
    # planned == allocated: the K + 1 spec slots per sequence are in the pools the plan counted, and each slot
    # row's MTP hidden row (spec/hidden_rows.py) beside them
    assert sum(engine.runner.pools.nbytes().values()) + engine.slot_hidden.nbytes == engine.plan.total_bytes
    outputs = engine.generate([prompts[i] for i in chosen], SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    for i, out in zip(chosen, outputs):
        assert out.error is None, out.error
        assert out.token_ids == references[i][len(prompts[i]):len(prompts[i]) + NEW_TOKENS], f"prompt {i}"
    stats = engine.stats()
    if method == "oracle":
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert all(0 < rate < 1 for rate in stats["spec_acceptance_rate_per_position"][:k - 1])
        assert engine.speculator.drafter.released >= {out.request_id for out in outputs}
    if blocks is not None:
        assert stats["preemptions"] > 0, "the budget was meant to force preemption"
    assert_drained(engine)


def test_batch_invariant_mode_speculates_bit_for_bit(model, prompts, references):
    """scheduler.batch_invariant: a request's logprobs are the same bits alone and among neighbours (whose
    drafts change how many of its own are accepted: the oracle's cycle is shared), and equal to rounding
    without speculation."""
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0)

    def run(method, chosen):
        engine = engine_for(model, references, method, k=3, chunk=128, batch_invariant=True, prefix=False)
        outputs = engine.generate([prompts[i] for i in chosen], params, use_tqdm=False)
        assert method is None or engine.stats()["spec_accepted_tokens"] > 0
        assert_drained(engine)
        return outputs[0]

    alone, mixed, plain = run("oracle", [7]), run("oracle", [7, 10, 2, 9]), run(None, [7])
    assert alone.token_ids == mixed.token_ids == plain.token_ids == references[7][33:33 + NEW_TOKENS]
    bits = [[lp.logprob for lp in out.logprobs] for out in (alone, mixed, plain)]
    assert bits[0] == bits[1]
    # without speculation the prompt's last token runs inside its prefill chunk (KDA's chunked form), with
    # it as the first token of a verify step (the recurrent step): the same state to rounding
    torch.testing.assert_close(torch.tensor(bits[0]), torch.tensor(bits[2]), atol=1e-5, rtol=0)


def _kda_layers(pools):
    return [pools.layer(i) for i in range(len(pools)) if isinstance(pools.layer(i), KDAPool)]


@torch.no_grad()
@pytest.mark.parametrize("paged_decode", ["fused", "recurrent"])
def test_kda_state_after_verify_equals_a_plain_run_for_every_accepted_count(model, paged_decode):
    """One verify step of K = 4 drafts leaves in spec slot j the state (and conv tail) that decoding x0, d1 .. dj
    one token at a time leaves: whatever j the engine then accepts, it continues from a plain run's state."""
    for layer in model.layers:
        if hasattr(layer.attn, "paged_decode"):
            layer.attn.paged_decode = paged_decode
    k, prompt = 4, torch.randint(0, 256, (13,)).tolist()
    tokens = torch.randint(0, 256, (k + 1,)).tolist()  # x0 and the drafts
    spec_pools, plain_pools = (PagedPools(model.config, 8, 16, k + 3) for _ in range(2))
    for pools in (spec_pools, plain_pools):  # the prompt into slot 1 (a second sequence rides along in slot 0)
        model(torch.tensor([prompt]), batch=ForwardBatch.from_sequences([prompt], [0], [[0, 1]], [1], 16), pools=pools)
    verify = ForwardBatch.from_sequences([[7], tokens], [20, 13], [[2, 3], [0, 1]], [0, 1], 16)
    verify.decode = torch.tensor([True, False])
    verify.spec_slots = torch.tensor([[-1] * (k + 1), [1, 6, 2, 5, 3]])  # slots in no particular order
    model(verify.input_ids, batch=verify, pools=spec_pools)
    for j in range(k + 1):
        step = ForwardBatch.from_sequences([[tokens[j]]], [13 + j], [[0, 1]], [1], 16)
        step.decode = torch.tensor([True])
        model(step.input_ids, batch=step, pools=plain_pools)
        slot = int(verify.spec_slots[1, j])
        for spec_layer, plain_layer in zip(_kda_layers(spec_pools), _kda_layers(plain_pools)):
            torch.testing.assert_close(spec_layer.state[slot], plain_layer.state[1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(spec_layer.conv[slot], plain_layer.conv[1], atol=2e-5, rtol=1e-4)
    for layer in model.layers:
        if hasattr(layer.attn, "paged_decode"):
            layer.attn.paged_decode = "fused"


def test_bad_spec_slots_are_refused_naming_the_field(model):
    pools = PagedPools(model.config, 4, 16, 6)
    batch = ForwardBatch.from_sequences([[1, 2, 3], [4, 5]], [0, 0], [[0], [1]], [0, 1], 16)
    for spec, rule in (([[0, 2, 3], [1, 2, -1]], "written twice"), ([[0, 2, -1], [-1, -1, -1]], "row 0"),
                       ([[2, 3, 4], [-1, -1, -1]], "row 0"), ([[0, 2, 9], [-1, -1, -1]], "num_slots")):
        batch.spec_slots = torch.tensor(spec)
        with pytest.raises(ValueError, match=rf"batch\.spec_slots: .*{rule}"):
            model(batch.input_ids, batch=batch, pools=pools)


def test_a_prefix_hit_after_many_rejections_equals_a_fresh_engine(model, prompts, references):
    """Poisoning: the first requests' generated tokens run in verify steps full of rejections and cross block
    boundaries there; requests that extend them hit those blocks and snapshots and must get the logits of
    an engine that never speculated nor cached."""
    first = [prompts[i] for i in (6, 7, 9)]  # 31, 33, 65 tokens: 8+ generated tokens cross a block edge
    engine = engine_for(model, references, "oracle", k=5, chunk=64, snapshot_slots=64)
    runs = engine.generate(first, SamplingParams(max_tokens=24), use_tqdm=False)
    stats = engine.stats()
    assert stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] > 20, "the run was meant to reject a lot"
    extended = [p + out.token_ids + [11, 12, 13] for p, out in zip(first, runs)]
    params = SamplingParams(max_tokens=4, logprobs=3)
    hit = engine.generate(extended, params, use_tqdm=False)
    assert engine.stats()["prefix_hit_tokens"] >= 16 * sum((len(p) + 8) // 16 for p in first)
    fresh = Engine(model, service(None, prefix=False)).generate(extended, params, use_tqdm=False)
    for a, b in zip(hit, fresh):
        assert a.token_ids == b.token_ids
        # to rounding only: the hit and the fresh engine split the prompt into other chunks, so sums round
        # differently (measured: 4.8e-7, one ulp at |logprob| ~6); a poisoned row would move them far more
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), atol=2e-6, rtol=0)
    assert_drained(engine)


def test_rejection_step_samples_the_target_distribution():
    """The rule on its own with a dense q: draft ~ q, accept min(1, p/q), else norm(max(0, p - q))."""
    g = torch.Generator().manual_seed(3)
    p, q = torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = torch.zeros(4)
    for _ in range(4000):
        draft = int(torch.multinomial(q, 1, generator=g))
        counts[rejection_step(p, q, draft, g)[0]] += 1
    expected = p * 4000
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < 16.3, f"chi-square {statistic:.1f} (3 degrees of freedom, p < 0.001) for counts {counts}"


class GreedyTarget(Drafter):
    """Drafts the target's own greedy pick (one token): often the token a top-k sample picks, not always."""

    name = "greedy-target"

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def propose(self, request_id, draft_input, k):
        return [int(self.model(torch.tensor([list(draft_input.tokens)])).logits[0, -1].argmax())]


def test_sampled_tokens_follow_the_target_distribution_with_speculation(model, references):
    """Many seeds, top_k 3 at temperature 1: the joint distribution of the first two sampled tokens (the
    second one decided by a verify step, accepted or drawn from the residual) matches spec off."""
    prompt, seeds = references[2][:7], range(200)
    counts = []
    for method in (None, "ngram"):
        engine = Engine(model, service(method, k=3, max_num_seqs=48, cache_bytes=4_000_000))
        if method is not None:
            engine.speculator.drafter = GreedyTarget(model)
        outs = engine.generate([prompt] * len(seeds), [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s)
                                                       for s in seeds], use_tqdm=False)
        counts.append([tuple(o.token_ids[:2]) for o in outs])
        assert_drained(engine)
    stats = engine.stats()
    assert 20 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] - 20, stats  # accepts and rejects
    pairs = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.count(pair) for pair in pairs] for c in counts]
    keep = [j for j in range(len(pairs)) if table[0][j] + table[1][j] >= 10]  # chi-square needs filled cells
    other = [sum(row[j] for j in range(len(pairs)) if j not in keep) for row in table]
    table = [[row[j] for j in keep] + ([o] if sum(other) else []) for row, o in zip(table, other)]
    assert len(keep) >= 4 and chi2_contingency(table).pvalue > 1e-3, table


def test_abort_mid_verify_gives_every_slot_and_block_back(model, prompts, references):
    engine = engine_for(model, references, "oracle", k=4)
    ids = [engine.add_request(prompts[i], SamplingParams(max_tokens=12)) for i in (3, 8, 10)]
    for _ in range(4):
        engine.step()
    assert engine.stats()["spec_draft_tokens"] > 0 and engine.stats()["slots_used"] == 3 * 5
    engine.abort(ids[1])
    while engine.has_unfinished():
        engine.step()
    assert_drained(engine)
    assert engine.speculator.drafter.released >= set(ids)


def test_the_forward_process_verifies_drafts_too(model, prompts, references):
    """spec_slots travel to the worker with the step: greedy tokens still equal generate, drafts accepted."""
    engine = engine_for(model, references, "oracle", k=3, parallel={"forward_process": True})
    try:
        outputs = engine.generate([prompts[i] for i in (3, 7)], SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
        for i, out in zip((3, 7), outputs):
            assert out.token_ids == references[i][len(prompts[i]):len(prompts[i]) + NEW_TOKENS], f"prompt {i}"
        assert 0 < engine.stats()["spec_accepted_tokens"] < engine.stats()["spec_draft_tokens"]
        assert_drained(engine)
    finally:
        engine.close()


def test_metrics_export_the_spec_counters_under_vllm_names(model, prompts, references):
    from latentmoe_lab.server.prom import ServerMetrics

    engine = engine_for(model, references, "oracle", k=3)
    engine.generate([prompts[i] for i in (3, 7)], SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    stats, metrics = engine.stats(), ServerMetrics()
    metrics.observe_engine(stats)
    metrics.observe_engine(stats)  # counters add the engine's increments only
    text = metrics.exposition().decode()
    assert f"vllm:spec_decode_num_draft_tokens_total {float(stats['spec_draft_tokens'])}" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total {float(stats['spec_accepted_tokens'])}" in text
    for position, accepted in enumerate(stats["spec_accepted_per_position"]):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}} {float(accepted)}' in text
    assert stats["spec_accepted_tokens"] == sum(stats["spec_accepted_per_position"]) > 0


def test_a_failed_verify_step_is_recomputed_and_changes_nothing(model, prompts, references):
    """A forward that raises part way has advanced some spec slots: the step's sequences are recomputed
    (drafter forgotten, generators restored), so greedy and seeded sampled tokens equal an unfaulted run's.
    (Sampled tokens depend on the drafts, whose draws they consume: drafts that depend on the request's own
    tokens, like the n-gram drafter's, come back the same after a recompute.)"""
    from latentmoe_lab.serving.failures import StepError

    chosen = [prompts[i] for i in (3, 7, 9)]
    params = [SamplingParams(max_tokens=NEW_TOKENS), SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=5),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=5, seed=9)]

    def run(fail_at):
        engine = engine_for(model, references, "oracle", k=3)
        engine.speculator.drafter = RequestOracle(references)
        calls, failed = [0], []

        def hook(module, args, kwargs):
            calls[0] += 1
            if calls[0] == fail_at and kwargs["batch"].spec_slots is not None:
                failed.append(calls[0])
                raise RuntimeError("transient failure in a verify step")
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            ids, done = [engine.add_request(p, s) for p, s in zip(chosen, params)], {}
            while engine.has_unfinished():
                try:
                    outs = engine.step()
                except StepError as error:
                    outs = error.outputs
                done.update({o.request_id: o.token_ids for o in outs if o.finished})
        finally:
            handle.remove()
        assert_drained(engine)
        return [done[i] for i in ids], failed, engine.stats()

    clean, _, clean_stats = run(fail_at=None)
    faulted, failed, faulted_stats = run(fail_at=3)
    assert failed == [3] and faulted == clean
    assert clean[0] == references[3][15:15 + NEW_TOKENS]
    assert faulted_stats["spec_draft_tokens"] >= clean_stats["spec_draft_tokens"] > 0
