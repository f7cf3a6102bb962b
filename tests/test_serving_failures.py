"""A failed engine step: blame by bisection, retries, failing alone; reset; the bounded log (docs/design.md §6.5)."""
import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig, StepError
from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.planner import plan_cache
from latentmoe_lab.serving.scheduler import Scheduler
from latentmoe_lab.serving.sequence import Sequence

RETRIES = 2
NEW_TOKENS = 5
MAX_STEPS = 200  # a blame that never settles must fail the test, not hang it


def service(tight: bool = False, **scheduler) -> ServiceConfig:
    """4 slots for 5 requests (one waits), prefix caching on, chunks of 16: every scheduler rule in play.
    tight: 5 blocks of 16 in the pools, so that blocks run out and sequences are preempted too."""
    memory = {"block_size": 16, "max_num_seqs": 4, "prefix_cache": {}}
    data = {"model": {"max_model_len": 64 if tight else 128}, "memory": {**memory, "cache_bytes": 2_000_000},
            "scheduler": {"prefill_chunk_size": 16, "max_batch_size": 16, "max_step_retries": RETRIES, **scheduler}}
    if tight:
        plan = plan_cache(ModelConfig.from_preset("tiny"), ServiceConfig.from_dict(data))
        data["memory"]["cache_bytes"] = plan.pool_rows * plan.slot_bytes + 5 * plan.block_bytes
    return ServiceConfig.from_dict(data)


def innocents() -> list[tuple[list[int], SamplingParams]]:
    """Four ragged prompts (one over a block, one over a chunk), one of them sampled with a seed."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 40, 17]
    params = [SamplingParams(max_tokens=NEW_TOKENS)] * 3 + [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8,
                                                                          seed=11)]
    return [(torch.randint(0, 256, (n,), generator=g).tolist(), p) for n, p in zip(lengths, params)]


@pytest.fixture(scope="module")
def unfaulted(model):
    """The innocents' outputs in one engine without any fault, and a token none of them holds (the poison)."""
    requests = innocents()
    outs = Engine(model, service()).generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    seen = {t for (prompt, _), out in zip(requests, outs) for t in prompt + out.token_ids}
    return [o.token_ids for o in outs], next(t for t in range(256, 512) if t not in seen)


def raise_on_token(model, token):
    """A forward pre-hook: any step whose input_ids hold `token` raises (deterministically), up to MAX_STEPS
    times, so that a blame that never settles ends in a wrong result rather than a hang of generate()."""
    raised = [0]

    def hook(module, args):
        if bool((args[0] == token).any()) and raised[0] < MAX_STEPS:
            raised[0] += 1
            raise RuntimeError(f"poisoned by token {token}")
    return model.register_forward_pre_hook(hook)


def raise_on_call(model, call: int, min_batch: int):
    """A forward pre-hook that raises once, on the call-th forward, which must hold >= min_batch sequences."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == call:
            assert kwargs["batch"].num_seqs >= min_batch, "the faulted step must hold several requests"
            raise RuntimeError("transient failure")
    return model.register_forward_pre_hook(hook, with_kwargs=True)


def drive(engine, requests) -> tuple[list, list[StepError]]:
    """Step until done, collecting finished outputs (step()'s and StepError's) and the StepErrors."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done, errors = {}, []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        try:
            outs = engine.step()
        except StepError as error:
            errors.append(error)
            outs = error.outputs
        done.update({o.request_id: o for o in outs if o.finished})
    assert not engine.has_unfinished(), f"still unfinished after {MAX_STEPS} steps ({len(errors)} failed)"
    return [done[i] for i in ids], errors


def assert_drained(engine):
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["blocks_used"] == stats["slots_used"] == 0
    assert all(count == 0 for count in engine.block_manager.ref_count)


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight-preempting"])
def test_a_poison_request_fails_alone_and_its_step_mates_are_charged_nothing(model, unfaulted, tight):
    reference, poison = unfaulted
    requests = innocents()
    requests.insert(2, ([7, poison, 9], SamplingParams(max_tokens=NEW_TOKENS)))  # admitted with the others
    engine = Engine(model, service(tight))
    assert engine.block_manager.num_blocks == 5 if tight else engine.block_manager.num_blocks > 100
    handle = raise_on_token(model, poison)
    try:
        outs, errors = drive(engine, requests)
    finally:
        handle.remove()
    bad = outs.pop(2)
    assert [o.token_ids for o in outs] == reference
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error == f"engine_step_failed: RuntimeError: poisoned by token {poison} (after {RETRIES} retries)"
    assert [rid for e in errors for rid in e.retried] == [bad.request_id] * RETRIES  # nobody else charged
    assert len(errors[0].request_ids) > 1 and bad.request_id in errors[0].request_ids  # bisection began wide
    assert all(e.request_ids == [bad.request_id] for e in errors[-RETRIES - 1:])  # ... and ended on it alone
    assert isinstance(errors[0].cause, RuntimeError) and errors[0].__cause__ is errors[0].cause
    if tight:  # blocks ran out during the isolation too (a failure's own recompute is not counted here)
        assert sum(step.preemptions for step in engine.log.steps) > 0
    assert_drained(engine)


def test_generate_goes_through_a_poison_request(model, unfaulted):
    """The notebook path: generate() handles step failures itself; the poison's output carries the error."""
    reference, poison = unfaulted
    requests = innocents() + [([poison], SamplingParams(max_tokens=NEW_TOKENS))]
    engine = Engine(model, service())
    handle = raise_on_token(model, poison)
    try:
        outs = engine.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    finally:
        handle.remove()
    assert [o.token_ids for o in outs[:4]] == reference
    assert outs[4].finish_reason == "error" and outs[4].error.endswith(f"(after {RETRIES} retries)")
    assert_drained(engine)


@pytest.mark.parametrize("call", [1, 4], ids=["first-prefill", "mid-decode"])
def test_a_transient_failure_costs_a_recompute_and_no_retry(model, unfaulted, call):
    reference, _ = unfaulted
    engine = Engine(model, service())
    handle = raise_on_call(model, call, min_batch=2)
    try:
        outs, errors = drive(engine, innocents())
    finally:
        handle.remove()
    assert [o.token_ids for o in outs] == reference
    assert len(errors) == 1 and len(errors[0].request_ids) > 1 and errors[0].retried == []
    assert_drained(engine)


def test_max_step_retries_zero_fails_at_once_and_sampling_failures_are_step_failures(model, monkeypatch):
    engine = Engine(model, service(max_step_retries=0))
    monkeypatch.setattr("latentmoe_lab.serving.step_sampling.sample_token", lambda *a: 1 / 0)
    outs, errors = drive(engine, [([1, 2, 3], SamplingParams(max_tokens=2))])
    assert outs[0].error == "engine_step_failed: ZeroDivisionError: division by zero (after 0 retries)"
    assert len(errors) == 1 and errors[0].retried == []
    assert_drained(engine)


def test_reset_aborts_everything_and_forgets_the_prefix_cache(model, unfaulted):
    reference, _ = unfaulted
    engine = Engine(model, service())
    for prompt, params in innocents():
        engine.add_request(prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.stats()["blocks_used"] > 0 and engine.stats()["cached_blocks"] > 0
    aborted = engine.reset()
    assert sorted(o.finish_reason for o in aborted) == ["abort"] * 4
    assert_drained(engine)
    assert engine.stats()["cached_blocks"] == 0 and not engine.has_unfinished()
    outs, _ = drive(engine, innocents())  # the same pools serve again, to the same tokens
    assert [o.token_ids for o in outs] == reference
    engine.add_request([1, 2, 3])
    engine.block_manager.allocate_blocks(1)  # a leak that no request owns
    with pytest.raises(RuntimeError, match="reset: 1 blocks and 0 slots still held"):
        engine.reset()
    assert_drained(engine)  # rebuilt empty all the same


def test_the_engine_log_keeps_the_latest_records(model):
    engine = Engine(model, service(max_log_records=3))
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6), use_tqdm=False)
    steps = list(engine.log.steps)
    assert engine.stats()["steps"] > 3 and len(steps) == 3 and len(engine.log.requests) == 2
    assert steps[-1].running == 0 and [s.time for s in steps] == sorted(s.time for s in steps)
    with pytest.raises(ValueError, match="scheduler.max_log_records: must be a positive integer"):
        service(max_log_records=0)
    with pytest.raises(ValueError, match="scheduler.max_step_retries: must be an integer >= 0"):
        service(max_step_retries=-1)


# ------------------------------------------------------- scheduler groups, without a model
def _scheduler(budget=16):
    blocks = BlockManager(num_blocks=64, block_size=4, num_slots=8)
    return Scheduler(blocks, max_num_seqs=8, prefill_chunk_size=budget, chunked_prefill=True,
                     copy_slot=lambda src, dst: None)


def _step(scheduler) -> dict[str, int]:
    """One scheduled step with a token sampled for each emitting entry -> {name: new tokens}."""
    batch = scheduler.schedule()
    scheduler.finish_step(batch, {s.request_id: [7] for (s, _), e in zip(batch.entries, batch.emits()) if e})
    return {"abcde"[s.request_id]: n for s, n in batch.entries}


def test_a_group_steps_alone_others_progress_and_membership_ends_at_the_failed_token():
    scheduler = _scheduler()
    a, b, c, d, e = (Sequence(i, [1] * n, SamplingParams(max_tokens=6)) for i, n in enumerate([3, 3, 20, 3, 3]))
    for seq in (a, b, c, d):
        scheduler.add(seq)
    scheduler.isolate([a, b, c, d])  # as after a failed step of these four
    scheduler.add(e)
    assert (a.isolation_group, c.isolation_group) == (b.isolation_group, d.isolation_group)
    assert a.isolation_group != c.isolation_group
    assert _step(scheduler) == {"a": 3, "b": 3}  # group {a, b}: c heads the queue but is not a member
    assert a.isolation_group is b.isolation_group is None  # each emitted the token the failure was computing
    assert _step(scheduler) == {"c": 16}  # group {c, d}: c's first chunk takes the budget
    assert c.isolation_group is not None  # a chunk that emits nothing: c is still isolated
    assert _step(scheduler) == {"a": 1, "b": 1}  # the ordinary turn: decodes; e waits behind d (first come)
    assert _step(scheduler) == {"c": 4, "d": 3}  # the group again: c ends its prompt, d is admitted
    assert c.isolation_group is d.isolation_group is None
    assert _step(scheduler) == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 3}  # one cohort again
    # a decode step of a and b fails: halves {a} and {b}; a group's turn comes first, before the ordinary one
    for seq in (b, a):
        scheduler.preempt(seq)
    scheduler.isolate([a, b])
    assert a.isolated_until == 3 and a.isolation_group != b.isolation_group
    assert _step(scheduler) == {"a": 6}  # prompt + 3 tokens recomputed, then its 4th token
    assert a.generated_ids == [7] * 4 and a.isolation_group is None and b.isolation_group is not None
    assert _step(scheduler) == {"b": 6}
    assert _step(scheduler) == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}
    while scheduler.num_unfinished:
        _step(scheduler)
    assert scheduler.blocks.blocks_used == 0 and scheduler.blocks.slots_used == 0


def test_isolate_splits_in_halves_and_a_lone_sequence_gets_its_own_group():
    scheduler = _scheduler()
    seqs = [Sequence(i, [1, 2], SamplingParams()) for i in range(5)]
    scheduler.isolate(seqs)
    assert [s.isolation_group for s in seqs] == [0, 0, 0, 1, 1]
    scheduler.isolate(seqs[:1])
    assert seqs[0].isolation_group == 2 and seqs[0].isolated_until == 0
