"""EPLB while serving (parallel/eplb/online.py, replicas.py): replica choice, slot migration, the online
schedule, the load recorder against the router, and EP2 / EP4 engines whose greedy tokens survive rebalances."""
import sysconfig

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder
from latentmoe_lab.parallel.eplb.online import ExpertSlots, OnlineBalancer
from latentmoe_lab.parallel.eplb.rebalance import rebalance_experts
from latentmoe_lab.parallel.eplb.replicas import (check_placement, choose_replicas, choose_replicas_reference,
                                                  slot_tables)
from latentmoe_lab.parallel.launch import launch
from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
from latentmoe_lab.parallel.runs import RunSettings, build_reference
from latentmoe_lab.parallel.sharded import parallelize
from latentmoe_lab.server.prom import ServerMetrics
from latentmoe_lab.serving import Engine, ServiceConfig
from latentmoe_lab.training.lm import TrainSettings, train

from serving_cases import PARAMS, PROMPTS, SERVICE

FEW_PROMPTS = PROMPTS[2:6]  # 17, 40, 33 and 2 tokens: chunked prefills, decodes, 10+ steps


def test_replica_choice_prefers_own_rank_else_spreads_and_matches_its_twin():
    phy2log = torch.tensor([0, 1, 2, 3, 0, 4, 5, 6, 7, 1, 2, 3])  # 3 slots per rank; expert 0 on ranks 0, 1
    log2phy, logcnt = slot_tables(phy2log, 8, 5)
    indices = torch.randint(0, 8, (40, 2))
    for rank in range(4):
        chosen = choose_replicas(indices, log2phy, logcnt, rank, 3)
        assert torch.equal(chosen, choose_replicas_reference(indices, log2phy, logcnt, rank, 3))
        assert torch.equal(phy2log[chosen], indices)  # always a replica of the routed expert
    hot = (indices == 0).nonzero(as_tuple=True)
    replicas = log2phy[0, :logcnt[0]]
    off_rank = [r for r in range(4) if not (replicas // 3 == r).any()]
    used = choose_replicas(indices, log2phy, logcnt, off_rank[0], 3)[hot]
    assert set(used.tolist()) == set(replicas.tolist())  # spread over every replica
    own = int(replicas[0]) // 3
    assert (choose_replicas(indices, log2phy, logcnt, own, 3)[hot] // 3 == own).all()


def test_slot_migration_copies_exactly_the_changed_slots():
    torch.manual_seed(1)
    experts = LatentExperts(4, 8, 6)
    torch.nn.init.normal_(experts.w13)
    torch.nn.init.normal_(experts.w2)
    before, after = torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([0, 3, 2, 1, 2, 1])
    slots = ExpertSlots(experts, before, rank=1, ep=2, tp_index=0, tp=1)  # rank 1 holds slots 3, 4, 5
    log2phy = slots.log2phy
    moved = slots.migrate(after)
    expert_bytes = (8 * 12 + 6 * 8) * 4
    assert moved == 2 * expert_bytes  # slots 3 (3 -> 1) and 4 (0 -> 2) on this rank
    for local, expert in enumerate(after[3:].tolist()):
        assert torch.equal(slots.experts.w13[local], experts.w13[expert])
        assert torch.equal(slots.experts.w2[local], experts.w2[expert])
    assert slots.log2phy is log2phy and log2phy[2].tolist()[:2] == [2, 4]  # updated in place
    assert slots.logcnt.tolist() == [1, 2, 2, 1]


def test_online_balancer_moves_a_few_layers_per_step():
    balancer = OnlineBalancer(num_layers=3, num_experts=8, ep=2, num_redundant=2, num_groups=1, interval_steps=2,
                              layers_per_step=2)
    window = torch.zeros(3, 8)
    window[:, 5] = 100  # expert 5 hot in every layer: every layer's placement changes
    assert balancer.updates(window, 1) == {}  # not a rebalance step
    first = balancer.updates(window, 2)
    second = balancer.updates(window, 3)
    third = balancer.updates(window, 4)
    # staged with one step, switched with the next (parallel/eplb/migration.py)
    assert sorted(first["stage"]) == [0, 1] and first["commit"] == {}
    assert sorted(second["commit"]) == [0, 1] and sorted(second["stage"]) == [2]
    assert sorted(third["commit"]) == [2] and third["stage"] == {} and balancer.updates(window, 5) == {}
    # packing-aware counts: two replicas of the hot expert, one per rank (the plain greedy's three leave
    # one rank with two: 66.7 tokens against 50)
    phy2log, logcnt = balancer.slots()
    assert (logcnt[:, 5] == 2).all() and ((phy2log.view(3, 2, 5) == 5).sum(-1) == 1).all()
    with pytest.raises(ValueError, match="^eplb.num_redundant_experts:"):
        OnlineBalancer(3, 8, 2, 1, 1, 2, 1)
    with pytest.raises(ValueError, match="^eplb.num_redundant_experts: 10008 expert slots per layer, more than 16"):
        OnlineBalancer(3, 8, 2, 10 ** 4, 1, 2, 1)  # before the first rebalance runs, not minutes into it


def test_recorder_counts_equal_the_routers(model):
    recorder = ExpertLoadRecorder.for_model(model, window_steps=2)
    routed = []

    def count_routing(layer, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        routed.append(torch.bincount(layer.route(x)[1].reshape(-1), minlength=layer.num_experts))

    layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
    hooks = [layer.register_forward_pre_hook(count_routing) for layer in layers] + [recorder.attach(model)]
    try:
        steps = []
        with torch.no_grad():
            for seed in range(3):
                routed.clear()
                model(torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(seed)))
                steps.append(torch.stack(routed))
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(recorder.total, sum(steps))
    assert torch.equal(recorder.window, steps[1] + steps[2])  # the sliding window dropped step 0
    assert (recorder.window.sum(1) == 2 * 2 * 7 * model.config.moe.top_k).all()
    with pytest.raises(ValueError, match="^window_steps:"):
        ExpertLoadRecorder(3, 8, 0)


def test_the_trainer_records_the_window_it_balanced_with():
    settings = TrainSettings(preset="tiny", steps=2, batch=2, seq_len=16, warmup=1, eval_every=2, eval_rows=1,
                             sample_tokens=0, threads=1, corpus_root=sysconfig.get_paths()["stdlib"] + "/json",
                             held_out_fraction=0.3)
    history = train(settings)
    window = torch.tensor(history.expert_window)
    assert window.shape == (3, 8)  # tiny: 3 MoE layers of 8 experts
    assert (window.sum(1) == 2 * 2 * 16 * 2).all()  # 2 steps x 2 rows x 16 tokens x top-2, every layer


def test_eplb_section_is_checked():
    with pytest.raises(ValueError, match="^eplb.enabled:"):
        ServiceConfig.from_dict(SERVICE | {"eplb": {"enabled": True}})
    with pytest.raises(ValueError, match="^eplb.layers_per_step:"):
        ServiceConfig.from_dict(SERVICE | {"eplb": {"layers_per_step": 0}})
    ep2 = SERVICE | {"parallel": {"expert_parallel_size": 2}}
    # sizes that used to pass: a window of 10**12 steps (an allocator error at start), 10**6 replicas
    with pytest.raises(ValueError, match="^eplb.window_steps: at most 100000 steps"):
        ServiceConfig.from_dict(ep2 | {"eplb": {"enabled": True, "window_steps": 10**12}})
    with pytest.raises(ValueError, match="^eplb.num_redundant_experts: at most 8192"):
        ServiceConfig.from_dict(ep2 | {"eplb": {"enabled": True, "num_redundant_experts": 10**6}})


@pytest.mark.parametrize("redundant, message", [(3, "must divide by parallel.expert_parallel_size"),
                                                (10, "18 expert slots per layer, more than 16")])
def test_the_service_files_plan_refuses_what_the_engine_would_before_building_it(redundant, message):
    """plan-service / serve-bench / serve load through check_engine_plan, which knows the preset's experts."""
    from latentmoe_lab.serving.service_plan import check_engine_plan

    config = ServiceConfig.from_dict(SERVICE | {"parallel": {"expert_parallel_size": 2},
                                                "eplb": {"enabled": True, "num_redundant_experts": redundant}})
    with pytest.raises(ValueError, match=f"^eplb.num_redundant_experts: .*{message}"):
        check_engine_plan(config)


@pytest.fixture(scope="module")
def one_process(model):
    """(greedy tokens, routed tokens per [layer][expert]) of the one-process engine on FEW_PROMPTS."""
    engine = Engine(model, ServiceConfig.from_dict(SERVICE))
    tokens = [o.token_ids for o in engine.generate(FEW_PROMPTS, PARAMS, use_tqdm=False)]
    return tokens, engine.stats()["expert_tokens"]


@pytest.mark.parametrize("ep,redundant,tp,pp", [(2, 2, 1, 1), (4, 4, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2)])
def test_greedy_tokens_unchanged_through_online_rebalances(model, one_process, ep, redundant, tp, pp):
    reference, routed = one_process
    service = SERVICE | {"parallel": {"expert_parallel_size": ep, "tensor_parallel_size": tp,
                                      "pipeline_parallel_size": pp},
                         "eplb": {"enabled": True, "num_redundant_experts": redundant, "window_steps": 4,
                                  "rebalance_interval_steps": 3, "layers_per_step": 1}}
    engine = Engine(model, ServiceConfig.from_dict(service))
    try:
        outputs = engine.generate(FEW_PROMPTS, PARAMS, use_tqdm=False)
        stats = engine.stats()
    finally:
        engine.close()
    assert [o.token_ids for o in outputs] == reference  # before, during and after the migrations
    balancer = engine.balancer
    assert balancer.rebalances >= 2 and balancer.slots_moved > 0
    moe = model.config.moe
    expert_bytes = 3 * moe.latent_size * moe.expert_intermediate_size * 4  # fp32 w13 + w2, over the tp slices
    assert stats["eplb_bytes_moved"] == balancer.slots_moved * expert_bytes  # moved == planned
    # the workers' counts are the one-process engine's: the same steps route the same tokens
    assert stats["expert_tokens"] == routed
    assert 0 < stats["expert_balancedness"] <= 1


def test_metrics_export_balancedness_and_per_expert_tokens():
    metrics = ServerMetrics()
    base = {"running": 0, "waiting": 0, "blocks_used": 0, "num_blocks": 8, "slots_used": 0, "num_slots": 2,
            "cached_blocks": 0, "preemptions": 0, "prefix_hit_tokens": 0, "worker_restarts": 0,
            "rank_forward_seconds": [], "rank_collective_seconds": [], "rank_resident_bytes": []}
    metrics.observe_engine(base | {"expert_balancedness": 0.5, "expert_tokens": [[3, 0], [1, 2]],
                                   "eplb_bytes_moved": 100})
    metrics.observe_engine(base | {"expert_balancedness": 0.75, "expert_tokens": [[5, 0], [1, 4]],
                                   "eplb_bytes_moved": 300})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.exposition().decode()) for s in f.samples}
    assert samples[("latentmoe_expert_balancedness", ())] == 0.75
    assert samples[("latentmoe_expert_tokens_total", (("expert", "0"), ("layer", "0")))] == 5
    assert samples[("latentmoe_expert_tokens_total", (("expert", "1"), ("layer", "1")))] == 4
    assert samples[("latentmoe_eplb_bytes_moved_total", ())] == 300


def _replicated_layout_worker(placement):
    """Per rank: the hand-written EP2 layout with EPLB slots against the single-device logits and tokens."""
    _, device = init_distributed(20)
    model, prompt = build_reference(RunSettings(batch=2, seq_len=12))
    with torch.no_grad():
        expected = model(prompt).logits
    expected_tokens = model.generate(prompt, max_new_tokens=3)
    sharded = parallelize(model, Comm(ProcessMesh(ParallelConfig(ep=2), device)), placement)
    local = sharded.local_inputs(prompt)
    logits = sharded.gather_logits(sharded(local), local.shape[0], local.shape[1])
    tokens = sharded.generate(prompt, 3)
    return {"error": float((logits - expected).abs().max()), "tokens_equal": bool(torch.equal(tokens, expected_tokens))}


def test_the_hand_written_ep_layout_runs_on_an_eplb_placement():
    weight = torch.tensor([[40.0, 1, 1, 1, 1, 1, 1, 30]]).repeat(3, 1)  # experts 0 and 7 hot in every MoE layer
    placement = rebalance_experts(weight, 12, 1, 1, 2)[0]
    assert (torch.stack([torch.bincount(row, minlength=8) for row in placement])[:, [0, 7]] > 1).all()
    for result in launch(_replicated_layout_worker, 2, args=(placement,), timeout_s=120):
        assert result["error"] <= 1e-5 and result["tokens_equal"]
    with pytest.raises(ValueError, match="^placement:"):
        check_placement(placement[:, :11], 3, 8, 2)
    with pytest.raises(ValueError, match="^placement:"):
        check_placement(torch.zeros(3, 12, dtype=torch.int64), 3, 8, 2)
