"""An EPLB placement on the native EP layout (latentmoe_lab/native/eplb.py, docs/design.md §14).

The placement is rebalance_experts' phy2log, the one the hand-written layout takes. Checked here, on the
tiny preset (3 MoE layers x 8 experts) over gloo processes on 127.0.0.1:
- a permutation placement trains EP2, FSDP2xEP2, EP2xTP2 and PP2xEP2 like one process (logits, gradient
  norms and parameters after 2 AdamW steps, fp64; the 4-process layouts in one launch; under PP each stage
  takes its own placement rows);
- with 4 replicas, EP2, EP2xTP2 and FSDP2xEP2 train like one process too, the replicas staying identical
  (their gradients summed); the forward equals the hand-written layout on the same placement;
- a checkpoint saved under one placement loads under another (with or without replicas) and into one
  plain process, and equals the trained model; the files hold the experts in logical order;
- move_rows and sum_rows (the All-to-Alls of the checkpoint mapping and the replica gradients) against
  plain indexing and index_add, and the planned All-to-All bytes of a step under a placement (with and
  without replicas) against the measured ones.
"""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.equivalence import (EquivalenceSettings, check_layouts, compare_with_hand_written,
                                              training_batches, write_reference_checkpoint)
from latentmoe_lab.native.eplb import check_native_placement, first_replicas
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.rebalance import rebalance_experts
from latentmoe_lab.parallel.launch import launch

CONFIG = ModelConfig.from_preset("tiny")
LAYERS, EXPERTS = 3, CONFIG.moe.num_experts


def skewed_placement(num_slots: int, seed: int) -> torch.Tensor:
    """rebalance_experts on a seeded skewed load over 2 ranks (global policy)."""
    weight = torch.rand(LAYERS, EXPERTS, generator=torch.Generator().manual_seed(seed)) ** 4 * 100
    return rebalance_experts(weight, num_slots, 1, 1, 2)[0]


PERMUTATION = skewed_placement(EXPERTS, 0)          # [3, 8], every expert once
OTHER_PERMUTATION = skewed_placement(EXPERTS, 1)
REPLICATED = skewed_placement(EXPERTS + 4, 2)       # [3, 12]: 4 redundant slots


def test_the_placements_move_experts_across_ranks():
    """The premise: experts leave their contiguous rank, and REPLICATED holds replicas."""
    for placement in (PERMUTATION, OTHER_PERMUTATION):
        assert (placement[:, :4].sort().values != torch.arange(4)).any()
    assert (torch.stack([torch.bincount(row, minlength=EXPERTS) for row in REPLICATED]) > 1).any()


TRAINED_LAYOUTS = {  # name -> (layout, placement)
    "EP2": (NativeLayout(ep=2), PERMUTATION), "FSDP2xEP2": (NativeLayout(dp_shard=2, ep=2), PERMUTATION),
    "EP2xTP2": (NativeLayout(ep=2, tp=2), PERMUTATION), "PP2xEP2": (NativeLayout(pp=2, ep=2), PERMUTATION),
    "EP2 + 4 replicas": (NativeLayout(ep=2), REPLICATED),
    "EP2xTP2 + 4 replicas": (NativeLayout(ep=2, tp=2), REPLICATED),
    "FSDP2xEP2 + 4 replicas": (NativeLayout(dp_shard=2, ep=2), REPLICATED)}


@pytest.fixture(scope="module")
def trained_reports():
    layouts, placements = zip(*TRAINED_LAYOUTS.values())
    reports = check_layouts(list(layouts), EquivalenceSettings(steps=2), placements=list(placements))
    return dict(zip(TRAINED_LAYOUTS, reports))


@pytest.mark.parametrize("name", list(TRAINED_LAYOUTS))
def test_a_placement_trains_like_one_process(trained_reports, name):
    report = trained_reports[name]
    assert report.extra["replica_spread"] == 0.0  # AdamW moved every replica alike
    # the clipping norm counts a replicated expert once (counting each replica moves it by ~1e-6 relative)
    assert report.extra["grad_norms"] == pytest.approx(report.extra["reference_grad_norms"], rel=1e-8)
    assert report.max_logit_error <= 1e-5
    assert report.compared_params > 0 and report.max_param_error <= 1e-5, report.extra["worst_param"]
    assert report.losses == pytest.approx(report.reference_losses, abs=1e-5)
    assert report.reference_losses[0] != report.reference_losses[-1]


def test_a_dispatcher_that_ignores_the_placement_is_caught(monkeypatch):
    """The check can fail: pairs sent by logical id to a slot-ordered stack reach the wrong experts."""
    monkeypatch.setattr("latentmoe_lab.native.expert.choose_replicas", lambda indices, *args: indices)
    report, = check_layouts([NativeLayout(ep=2)], EquivalenceSettings(steps=1), placements=[PERMUTATION])
    assert report.max_logit_error > 1e-3


def test_replicas_serve_like_the_hand_written_layout():
    """Forward with 4 redundant slots: native logits equal parallel/'s on the same placement (and those equal
    one process: tests/test_eplb_online.py)."""
    difference, = compare_with_hand_written([(ParallelConfig(ep=2), NativeLayout(ep=2))], placement=REPLICATED)
    assert difference <= 1e-5


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match="^placement: needs expert parallelism"):
        check_native_placement(PERMUTATION, CONFIG, ep=1)
    with pytest.raises(ValueError, match="^placement:"):
        check_native_placement(PERMUTATION[:2], CONFIG, ep=2)        # a row per MoE layer
    with pytest.raises(ValueError, match="^placement:"):
        check_native_placement(REPLICATED[:, :11], CONFIG, ep=2)     # slots not divisible by ep
    missing = PERMUTATION.clone()
    missing[0, 0] = missing[0, 1]                                     # an expert without a slot
    with pytest.raises(ValueError, match="^placement:"):
        check_native_placement(missing, CONFIG, ep=2)


def _checkpoint_worker(reference: str, saved: str, settings: EquivalenceSettings) -> dict:
    """Train 1 step under PERMUTATION, save; load under OTHER_PERMUTATION (with the optimizer) and REPLICATED."""
    import torch.distributed as dist

    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.checkpoint import load_sharded, save_sharded
    from latentmoe_lab.native.equivalence import logical_parameters
    from latentmoe_lab.native.eplb import move_rows, sum_rows
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.native.traffic import CollectiveMeter, RoutingRecorder, plan_step_bytes
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(60)
    torch.set_num_threads(1)
    dtype = getattr(torch, settings.dtype)
    layout = NativeLayout(ep=2)
    batches = training_batches(CONFIG, settings)
    # move_rows against plain indexing: 12 rows in 2 blocks -> 8 rows picked with repeats, in 2 blocks
    whole = torch.arange(12 * 3, dtype=torch.float64).view(12, 3)
    source = torch.tensor([11, 0, 5, 5, 6, 1, 11, 2])
    rank = dist.get_rank()
    moved = move_rows(whole[rank * 6:(rank + 1) * 6], source, 12, dist.group.WORLD)
    rows_ok = torch.equal(moved, whole[source][rank * 4:(rank + 1) * 4])
    # sum_rows against index_add: 8 slots of 6 experts (0 and 3 twice) in 2 blocks -> 6 sums in 2 blocks
    phy2log = torch.tensor([3, 0, 5, 1, 0, 2, 4, 3])
    summed = sum_rows(whole[:8][rank * 4:(rank + 1) * 4], phy2log, 6, dist.group.WORLD)
    sums = torch.zeros(6, 3, dtype=torch.float64).index_add_(0, phy2log, whole[:8])
    rows_ok = rows_ok and torch.equal(summed, sums[rank * 3:(rank + 1) * 3])

    first = build_native(CONFIG, layout, build_mesh(layout), reference, dtype=dtype, placement=PERMUTATION)
    trainer = NativeTrainer(first, lr=settings.lr)
    with CollectiveMeter() as meter, RoutingRecorder(first.module) as routing:
        trainer.step(batches[0])
    planned = plan_step_bytes(first, layout, routing.gathered(first.mesh["ep"]))
    measured = {kind: n for kind, n in meter.bytes.items() if kind.startswith(("fsdp.", "ep.")) and n}
    save_sharded(first, saved, optimizer=trainer.optimizer)
    trained_logits = native_logits(first, batches[1])
    trained = logical_parameters(first.module)
    trainer.step(batches[1])  # the step a resume must repeat exactly
    after_two = logical_parameters(first.module)

    resumed = build_native(CONFIG, layout, build_mesh(layout), reference, dtype=dtype, placement=OTHER_PERMUTATION)
    resumed_trainer = NativeTrainer(resumed, lr=settings.lr)
    load_sharded(resumed, saved, optimizer=resumed_trainer.optimizer)
    loaded = logical_parameters(resumed.module)
    resumed_trainer.step(batches[1])
    resumed_after_two = logical_parameters(resumed.module)

    replicated = build_native(CONFIG, layout, build_mesh(layout), reference, dtype=dtype, placement=REPLICATED)
    load_sharded(replicated, saved)
    replicated_logits = native_logits(replicated, batches[1])
    with CollectiveMeter() as meter, RoutingRecorder(replicated.module) as routing:
        NativeTrainer(replicated, lr=settings.lr).step(batches[1])  # with the replicas' gradient sums
    planned_replicated = plan_step_bytes(replicated, layout, routing.gathered(replicated.mesh["ep"]))
    measured_replicated = {kind: n for kind, n in meter.bytes.items() if kind.startswith(("fsdp.", "ep.")) and n}
    error = lambda a, b: max(float((a[k] - b[k]).abs().max()) for k in a)  # noqa: E731
    return {"rows_ok": rows_ok, "planned": dict(planned), "measured": measured,
            "planned_replicated": dict(planned_replicated), "measured_replicated": measured_replicated,
            "trained_logits": trained_logits, "trained": trained,
            "load_error": error(loaded, trained), "resume_error": error(resumed_after_two, after_two),
            "replicated_logit_error": float((replicated_logits - trained_logits).abs().max())}


def test_checkpoints_map_between_placements_and_the_plain_model(tmp_path):
    settings = EquivalenceSettings(steps=2)
    write_reference_checkpoint(settings, tmp_path / "reference")
    saved = tmp_path / "saved"
    ranks = launch(_checkpoint_worker, 2, args=(str(tmp_path / "reference"), str(saved), settings), timeout_s=240)
    for result in ranks:
        assert result["rows_ok"]
        # the All-to-All bytes follow the placement: planned from the routing, equal to the measured ones
        assert result["planned"]["ep.all_to_all.rows"] > 0 and result["planned"] == result["measured"]
        assert result["planned_replicated"] == result["measured_replicated"]
        assert result["load_error"] == 0.0              # placement A -> disk -> placement B: bit for bit
        assert result["resume_error"] <= 1e-12          # the optimizer state followed its experts
        assert result["replicated_logit_error"] <= 1e-10
    from latentmoe_lab.native.checkpoint import load_sharded

    plain = LatentMoEForCausalLM(CONFIG).to(torch.float64)
    load_sharded(plain, saved)                          # no process group: the files are in logical order
    trained = ranks[0]["trained"]
    assert max(float((p.detach() - trained[n]).abs().max()) for n, p in plain.named_parameters()) == 0.0
    with torch.no_grad():
        logits = plain(training_batches(CONFIG, settings)[1]).logits
    assert float((logits - ranks[0]["trained_logits"]).abs().max()) <= 1e-10
    # and the trained experts did move away from the reference: the comparison above is not vacuous
    reference = LatentMoEForCausalLM.from_pretrained(tmp_path / "reference")
    assert not torch.equal(reference.layers[1].ffn.experts.w13.double(), plain.layers[1].ffn.experts.w13)


def test_first_replicas():
    assert first_replicas(torch.tensor([2, 0, 1, 2, 0, 3]), 4).tolist() == [1, 2, 0, 5]
