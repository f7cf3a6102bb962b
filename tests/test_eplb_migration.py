"""Expert migration off the step path (parallel/eplb/migration.py, online.py; docs/design.md §14): staging
against the in-place twin, the switch only once a layer's weights are in, the staged schedule, and EP2 /
EP2 x TP2 workers whose greedy tokens survive a rebalance in the middle of their requests."""
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from latentmoe_lab.layers.moe import LatentExperts
from latentmoe_lab.parallel.eplb.load import moe_layers
from latentmoe_lab.parallel.eplb.migration import SlotMigrator
from latentmoe_lab.parallel.eplb.online import ExpertSlots, OnlineBalancer
from latentmoe_lab.parallel.eplb.replicas import choose_replicas
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

from serving_cases import PROMPTS, SERVICE


def _experts(num_experts=6, latent=8, inter=6, dtype=torch.float32) -> LatentExperts:
    experts = LatentExperts(num_experts, latent, inter)
    torch.nn.init.normal_(experts.w13)
    torch.nn.init.normal_(experts.w2)
    return experts.to(dtype)


def _slots(experts, phy2log, rank, ep, tp_index=0, tp=1) -> ExpertSlots:
    slots = ExpertSlots(experts, phy2log, rank, ep, tp_index, tp)
    slots.layer = types.SimpleNamespace(experts=slots.experts)  # the LatentMoE a switch repoints
    return slots


def _placement(num_experts: int, num_slots: int, seed: int) -> torch.Tensor:
    """A random placement [num_slots]: every expert once, the rest random replicas, shuffled."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.cat([torch.arange(num_experts), torch.randint(0, num_experts, (num_slots - num_experts,),
                                                              generator=generator)])
    return row[torch.randperm(num_slots, generator=generator)]


def assert_routes_only_to_arrived_weights(slots: ExpertSlots) -> None:
    """Every pair the live tables send to this rank's slots lands on a slot holding that expert's weights, and
    the layer computes with those slots."""
    assert slots.layer.experts is slots.experts
    indices = torch.arange(len(slots.logcnt)).repeat(3, 1).T  # every expert, three tokens each
    for rank in range(len(slots.phy2log) // slots.slots_per_rank):
        chosen = choose_replicas(indices, slots.log2phy, slots.logcnt, rank, slots.slots_per_rank)
        assert torch.equal(slots.phy2log[chosen], indices)
        local = chosen - slots.first_slot
        mine = (local >= 0) & (local < slots.slots_per_rank)
        for name in ("w13", "w2"):
            assert torch.equal(getattr(slots.experts, name)[local[mine]], getattr(slots.host, name)[indices[mine]])


@pytest.mark.parametrize("num_slots, ep, rank, tp_index, tp, dtype", [
    (8, 2, 0, 0, 1, torch.float32), (9, 3, 2, 0, 1, torch.float32), (12, 2, 1, 1, 2, torch.bfloat16),
    (6, 1, 0, 0, 1, torch.float32)])
def test_staged_switch_equals_the_in_place_twin(num_slots, ep, rank, tp_index, tp, dtype):
    experts = _experts(dtype=dtype)
    before = _placement(6, num_slots, seed=num_slots)
    twin, staged_slots = (_slots(experts, before, rank, ep, tp_index, tp) for _ in range(2))
    spare = None  # the first staging allocates its buffer, the next ones reuse the retired one
    for step in range(3):  # placements that move some slots, all of them, or none
        after = _placement(6, num_slots, seed=100 + step) if step < 2 else staged_slots.phy2log.clone()
        mine = slice(twin.first_slot, twin.first_slot + twin.slots_per_rank)
        changed = int((after[mine] != twin.phy2log[mine]).sum())
        expert_bytes = sum(t[0].numel() * t.element_size() for t in (twin.host.w13, twin.host.w2))
        live = staged_slots.experts
        staged = staged_slots.stage(after, into=spare)
        assert staged_slots.experts is live and torch.equal(staged_slots.phy2log, twin.phy2log)  # nothing live moved
        assert spare is None or staged.experts is spare
        spare = staged_slots.switch(staged)
        assert spare is live and staged.moved == twin.migrate(after) == changed * expert_bytes  # moved == plan
        for name in ("w13", "w2"):
            assert torch.equal(getattr(staged_slots.experts, name), getattr(twin.experts, name))
        assert torch.equal(staged_slots.log2phy, twin.log2phy) and torch.equal(staged_slots.logcnt, twin.logcnt)
        assert_routes_only_to_arrived_weights(staged_slots)


def test_a_switch_refuses_a_staging_of_another_placement():
    experts = _experts()
    slots = _slots(experts, _placement(6, 8, 0), 0, 2)
    stale = slots.stage(_placement(6, 8, 1))
    slots.switch(slots.stage(_placement(6, 8, 2)))
    with pytest.raises(ValueError, match="^staged:"):
        slots.switch(stale)
    with pytest.raises(ValueError, match="^into:"):
        slots.stage(_placement(6, 8, 3), into=slots.experts)
    with pytest.raises(ValueError, match="^into:"):
        slots.stage(_placement(6, 8, 3), into=_experts(inter=4))


def test_a_layer_routes_by_its_new_placement_only_once_its_weights_are_in():
    experts = _experts()
    before, after = _placement(6, 8, 0), _placement(6, 8, 5)
    slots = _slots(experts, before, 1, 2)
    first_buffer = slots.experts
    assert (after[4:] != before[4:]).any()  # rank 1's slots change
    gate = threading.Event()
    executor = ThreadPoolExecutor(1)
    executor.submit(gate.wait)  # the side thread is busy: the staging waits behind it
    migrator = SlotMigrator({0: slots, 1: _slots(experts, before, 1, 2)}, executor)
    assert migrator.apply({"commit": {}, "stage": {0: after.tolist(), 7: after.tolist()}}) == 0  # 7: not held
    assert torch.equal(slots.phy2log, before)
    assert_routes_only_to_arrived_weights(slots)  # mid-migration: the old placement, whole
    moved = []
    commit = threading.Thread(target=lambda: moved.append(migrator.apply({"commit": {0: after.tolist()}})))
    commit.start()
    commit.join(0.5)
    assert commit.is_alive() and not moved  # the switch waits for the weights ...
    assert torch.equal(slots.phy2log, before)
    assert_routes_only_to_arrived_weights(slots)
    gate.set()
    commit.join(60)
    assert not commit.is_alive()  # ... and takes them once they are in
    assert torch.equal(slots.phy2log, after)
    assert_routes_only_to_arrived_weights(slots)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in (experts.w13, experts.w2))
    assert moved == [int((after[4:] != before[4:]).sum()) * expert_bytes]
    # the switch retired the old buffer; staging back into it allocates nothing
    assert migrator.spares == [first_buffer]
    migrator.apply({"stage": {0: before.tolist()}})
    assert not migrator.spares and migrator.apply({"commit": {0: before.tolist()}}) == moved[0]
    assert slots.experts is first_buffer and torch.equal(slots.phy2log, before)
    assert_routes_only_to_arrived_weights(slots)
    # a commit of a layer not staged here (a restarted group) copies it inside the step, to the same end
    assert migrator.apply({"commit": {1: after.tolist()}}) == moved[0]
    assert torch.equal(migrator.slots[1].phy2log, after)
    assert_routes_only_to_arrived_weights(migrator.slots[1])
    migrator.close()


@pytest.mark.parametrize("staged", [True, False])
def test_the_balancer_switches_a_layer_one_step_after_staging_it(staged):
    balancer = OnlineBalancer(num_layers=3, num_experts=8, ep=2, num_redundant=2, num_groups=1,
                              interval_steps=10 ** 9, layers_per_step=2, staged=staged)
    window = torch.zeros(3, 8)
    window[:, 5] = 100
    start = balancer.placement.clone()
    balancer.rebalance_next_step()
    steps = [balancer.updates(window, step) for step in range(4)]
    if staged:
        assert [(sorted(u["commit"]), sorted(u["stage"])) for u in steps[:3]] == [([], [0, 1]), ([0, 1], [2]),
                                                                                ([2], [])]
    else:  # the in-step baseline: switched in the step that hands the layer out
        assert [(sorted(u["commit"]), sorted(u["stage"])) for u in steps[:2]] == [([0, 1], []), ([2], [])]
    assert steps[-1] == {} and not balancer.migrating()
    switched = [row for update in steps if update for row in update["commit"].items()]
    assert balancer.slots_moved == sum(int((start[layer] != torch.tensor(row)).sum()) for layer, row in switched)
    assert all(torch.equal(balancer.placement[layer], torch.tensor(row)) for layer, row in switched)


def test_a_rebalance_to_a_given_placement_is_checked_and_migrated():
    balancer = OnlineBalancer(num_layers=2, num_experts=8, ep=2, num_redundant=2, num_groups=1,
                              interval_steps=10 ** 9, layers_per_step=2)
    target = torch.stack([_placement(8, 10, 1), _placement(8, 10, 2)])
    with pytest.raises(ValueError, match="^placement: expected 10 slots"):
        balancer.rebalance_next_step(torch.arange(8).repeat(2, 1))  # a valid placement without the spare slots
    with pytest.raises(ValueError, match="^placement:"):
        balancer.rebalance_next_step(torch.zeros(2, 10, dtype=torch.int64))  # experts without a slot
    balancer.rebalance_next_step(target)
    window = torch.ones(2, 8)
    assert sorted(balancer.updates(window, 0)["stage"]) == [0, 1] and balancer.migrating()
    assert sorted(balancer.updates(window, 1)["commit"]) == [0, 1]
    assert torch.equal(balancer.placement, target) and not balancer.migrating()


# ------------------------------------------------------------------ on the workers
FEW_PROMPTS = PROMPTS[2:5]  # 17, 40 and 33 tokens
PARAMS = SamplingParams(max_tokens=8, logprobs=0)  # each token's logprob: a wrong expert shows there first
LOGPROB_TOLERANCE = 1e-4  # fp32 sums in another order across the ranks


@pytest.fixture(scope="module")
def biased_model(model):
    """The module's tiny model with experts 0 and 4 drawing most tokens (the initial placement keeps both on
    rank 0 at EP2), so that a rebalance moves slots in every MoE layer."""
    for layer in moe_layers(model):
        layer.correction_bias[[0, 4]] = 0.5
    return model


def _serve_with_a_rebalance_mid_request(engine: Engine, expert_bytes: int) -> tuple[list, list[list[int]]]:
    """Serve FEW_PROMPTS, triggering a rebalance after the first decode step -> (the outputs, per step that
    switched slots the tokens generated so far by each request still running). Checks bytes moved == plan
    after every step."""
    ids = [engine.add_request(prompt, PARAMS) for prompt in FEW_PROMPTS]
    outputs, running_at_switches = {}, []
    while engine.has_unfinished():
        moved = engine.balancer.slots_moved
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        if engine.balancer.slots_moved > moved:
            running_at_switches.append([len(engine.sequence(i).generated_ids) for i in ids
                                        if engine.sequence(i) is not None])
        if engine.log.steps[-1].decode_tokens and not engine.balancer.rebalances:
            engine.balancer.rebalance_next_step()
        assert engine.runner.eplb_bytes_moved == engine.balancer.slots_moved * expert_bytes  # moved == planned
    return [outputs[i] for i in ids], running_at_switches


@pytest.mark.parametrize("ep, tp", [(2, 1), (2, 2)])
def test_a_rebalance_mid_request_leaves_greedy_tokens_unchanged(biased_model, ep, tp):
    memory = {key: value for key, value in SERVICE["memory"].items() if key != "enable_prefix_caching"}
    memory["prefix_cache"] = {"enabled": False}  # the second pass recomputes everything
    one_process = Engine(biased_model, ServiceConfig.from_dict(SERVICE | {"memory": memory}))
    reference = one_process.generate(FEW_PROMPTS, PARAMS, use_tqdm=False)
    service = SERVICE | {"memory": memory,
                         "parallel": {"expert_parallel_size": ep, "tensor_parallel_size": tp},
                         "eplb": {"enabled": True, "num_redundant_experts": 2, "window_steps": 1000,
                                  "rebalance_interval_steps": 10 ** 9, "layers_per_step": 1}}
    moe = biased_model.config.moe
    expert_bytes = 3 * moe.latent_size * moe.expert_intermediate_size * 4  # fp32 w13 + w2 over the tp slices
    engine = Engine(biased_model, ServiceConfig.from_dict(service))
    try:
        without = engine.generate(FEW_PROMPTS, PARAMS, use_tqdm=False)
        assert engine.balancer.slots_moved == 0  # no rebalance on its own
        with_rebalance, running_at_switches = _serve_with_a_rebalance_mid_request(engine, expert_bytes)
    finally:
        engine.close()
    for outputs in (without, with_rebalance):
        assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
        logprobs = torch.tensor([p.logprob for o in outputs for p in o.logprobs])
        assert torch.allclose(logprobs, torch.tensor([p.logprob for o in reference for p in o.logprobs]),
                              rtol=0, atol=LOGPROB_TOLERANCE)
    # the three MoE layers switched one per step, each while requests were part-way through their tokens
    assert len(running_at_switches) == 3, running_at_switches
    assert all(any(0 < n < PARAMS.max_tokens for n in running) for running in running_at_switches), running_at_switches
    assert engine.balancer.slots_moved > 0 and not engine.balancer.migrating()
