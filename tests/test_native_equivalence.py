"""The native layouts (torch's DeviceMesh, DTensor TP, FSDP2, autograd EP, pipelining) against one process.

Each layout starts from one checkpoint, runs the first batch forward, then 3 AdamW steps on the same
global batches as a single-process run; logits and every gathered parameter must agree to 1e-5. The
runs are in float64 (EquivalenceSettings.dtype): Adam's first steps are close to sign(g), so in fp32 a
gradient element near zero that differs by rounding alone could move a weight by up to lr. A layout
with a real mistake (a missing reduction, a wrong expert average) is off by about lr = 1e-3.
"""
import pytest

from latentmoe_lab.native.equivalence import EquivalenceSettings, check_layouts, compare_with_hand_written
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.parallel.config import ParallelConfig

TWO_PROCESS = {"FSDP2": NativeLayout(dp_shard=2), "TP2": NativeLayout(tp=2), "EP2": NativeLayout(ep=2),
               "PP2 (1F1B)": NativeLayout(pp=2, schedule="1f1b")}
FOUR_PROCESS = {"EP2xTP2": NativeLayout(ep=2, tp=2), "FSDP2xEP2": NativeLayout(dp_shard=2, ep=2),
                "PP2xTP2 (GPipe)": NativeLayout(pp=2, tp=2)}
LAYOUTS = TWO_PROCESS | FOUR_PROCESS


@pytest.fixture(scope="module")
def reports():
    names = list(LAYOUTS)
    return dict(zip(names, check_layouts([LAYOUTS[n] for n in names], EquivalenceSettings(steps=3))))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_logits_equal_one_process(reports, name):
    assert reports[name].max_logit_error <= 1e-5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parameters_after_three_steps_equal_one_process(reports, name):
    report = reports[name]
    assert report.compared_params > 0
    assert report.max_param_error <= 1e-5, report.extra["worst_param"]
    assert report.losses == pytest.approx(report.reference_losses, abs=1e-5)
    # training moved the weights (by about lr per step), so a 1e-5 agreement is not vacuous
    assert report.reference_losses[0] != report.reference_losses[-1]


def test_a_missing_expert_average_is_caught(monkeypatch):
    """The check can fail: drop the train step's division of expert gradients by ep and EP2 is off by ~lr."""
    monkeypatch.setattr("latentmoe_lab.native.train.expert_params", lambda module: [])
    report, = check_layouts([NativeLayout(ep=2)], EquivalenceSettings(steps=1))
    assert report.max_param_error > 1e-4


def test_native_layouts_match_the_hand_written_ones():
    pairs = [(ParallelConfig(tp=2), NativeLayout(tp=2)), (ParallelConfig(ep=2), NativeLayout(ep=2)),
             (ParallelConfig(pp=2), NativeLayout(pp=2))]
    for difference in compare_with_hand_written(pairs):
        assert difference <= 1e-5
