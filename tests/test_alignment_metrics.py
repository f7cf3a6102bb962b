"""Alignment metrics on hand-made tensors; every expected value is worked out by hand in the comment."""
import math

import pytest
import torch

from latentmoe_lab.alignment import metrics
from latentmoe_lab.alignment.taps import ExpertChoice

R = torch.tensor([1.0, 2.0, 2.0])  # |r| = 3, sum r^2 = 9
C = torch.tensor([1.0, 2.0, 3.0])  # sum c^2 = 14, r.c = 1 + 4 + 6 = 11, c - r = [0, 0, 1]


def test_dense_metrics_by_hand():
    assert metrics.cosine(R, C) == pytest.approx(11 / (3 * math.sqrt(14)))
    assert metrics.relative_l2(R, C) == pytest.approx(1 / 3)
    assert metrics.rel_diff(R, C) == pytest.approx(1 - 22 / 23)  # 1 - 2*11 / (9 + 14)
    assert metrics.sqnr_db(R, C) == pytest.approx(10 * math.log10(9.0))  # signal 9, noise 1: 9.54 dB
    assert metrics.max_abs_error(R, C) == (1.0, (2,))


def test_max_abs_error_reports_the_index_in_the_original_shape():
    ref = torch.zeros(2, 3, 4)
    cand = ref.clone()
    cand[1, 2, 0], cand[0, 1, 3] = -5.0, 4.0
    assert metrics.max_abs_error(ref, cand) == (5.0, (1, 2, 0))
    cand[0, 0, 0] = float("nan")  # NaN is the worst error of all
    assert metrics.max_abs_error(ref, cand)[1] == (0, 0, 0)


def test_a_pure_scale_error_keeps_the_cosine_but_not_rel_diff():
    # c = 2r: cosine 1; rel_diff = 1 - 2*18 / (9 + 36) = 0.2; rel L2 = |r| / |r| = 1; sqnr = 10 log10(9/9) = 0
    assert metrics.cosine(R, 2 * R) == pytest.approx(1.0)
    assert metrics.rel_diff(R, 2 * R) == pytest.approx(0.2)
    assert metrics.relative_l2(R, 2 * R) == pytest.approx(1.0)
    assert metrics.sqnr_db(R, 2 * R) == pytest.approx(0.0)


def test_equal_and_all_zero_tensors():
    zero = torch.zeros(3)
    assert metrics.cosine(zero, zero) == 1.0 and metrics.cosine(zero, R) == 0.0
    assert metrics.relative_l2(zero, zero) == 0.0 and metrics.relative_l2(zero, R) == math.inf
    assert metrics.rel_diff(zero, zero) == 0.0
    assert metrics.sqnr_db(R, R) == math.inf and metrics.sqnr_db(zero, R) == -math.inf
    assert metrics.max_abs_error(R, R) == (0.0, (0,))


def test_shapes_must_match_and_inputs_must_be_tensors():
    with pytest.raises(ValueError, match="candidate: shape"):
        metrics.cosine(R, torch.ones(4))
    with pytest.raises(TypeError, match="reference: expected a tensor"):
        metrics.relative_l2([1.0], R)


def test_routing_flips_compare_expert_sets_and_weights_by_expert():
    ref = ExpertChoice(torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]]))
    # token 0: same set, other order (weights follow their experts: no error); token 1: set {2, 4}, a flip;
    # token 2: same set, weights 0.6 / 0.4 instead of 0.7 / 0.3 -> errors 0.1, 0.1
    cand = ExpertChoice(torch.tensor([[1, 0], [2, 4], [4, 5]]), torch.tensor([[0.4, 0.6], [0.5, 0.5], [0.6, 0.4]]))
    diff = metrics.routing_diff(ref, cand)
    assert (diff.tokens, diff.flipped) == (3, 1)
    assert diff.flip_rate == pytest.approx(1 / 3)
    assert diff.weight_max_abs == pytest.approx(0.1)
    assert diff.weight_mean_abs == pytest.approx(0.05)  # (0 + 0 + 0.1 + 0.1) / 4 pairs of unchanged sets
    everything_flipped = metrics.routing_diff(ExpertChoice(ref.indices[1:2], ref.weights[1:2]),
                                              ExpertChoice(cand.indices[1:2], cand.weights[1:2]))
    assert everything_flipped.flip_rate == 1.0 and everything_flipped.weight_max_abs == 0.0
    with pytest.raises(ValueError, match="expert indices"):
        metrics.routing_diff(ref, ExpertChoice(ref.indices[:2], ref.weights[:2]))


def test_kl_per_token_by_hand():
    # p = softmax(0, 0) = (1/2, 1/2), q = softmax(0, ln 3) = (1/4, 3/4):
    # KL = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3); the second token is equal: 0
    ref = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    cand = torch.tensor([[0.0, math.log(3.0)], [1.0, 2.0]])
    kl = metrics.kl_per_token(ref, cand)
    assert kl.tolist() == pytest.approx([0.5 * math.log(4 / 3), 0.0])
    assert metrics.kl_per_token(cand, ref)[0] > 0  # not symmetric, but both directions positive


def test_top1_agreement_and_bits_per_byte_by_hand():
    assert metrics.top1_agreement(torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
                                  torch.tensor([[0.0, 2.0], [0.0, 1.0]])) == 0.5
    uniform4 = torch.zeros(3, 4)  # CE = ln 4 nats = 2 bits, whatever the target
    targets = torch.tensor([0, 1, 3])
    assert metrics.bits_per_byte(uniform4, targets) == pytest.approx(2.0)
    halves = torch.tensor([[0.0, 0.0, -1e30, -1e30]]).repeat(3, 1)  # 1/2 on ids 0 and 1
    assert metrics.bits_per_byte(halves, torch.tensor([0, 1, 0])) == pytest.approx(1.0)
    assert metrics.bpb_delta(uniform4, halves, torch.tensor([0, 1, 0])) == pytest.approx(-1.0)  # 1 - 2 bits
    with pytest.raises(ValueError, match="targets"):
        metrics.bits_per_byte(uniform4, torch.tensor([0.0, 1.0, 2.0]))
