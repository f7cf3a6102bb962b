"""An expert-parallel rank that receives no rows must still take part in every backward collective.

The README's `train --preset tiny --fsdp 2 --ep 2` deadlocked at step 14 of seed 0: in one MoE layer no
token of either ep rank picked an expert of rank 1, so rank 1's expert product had no rows. The grouped
product returned a fresh empty tensor outside the autograd graph for that case, autograd then never
called the backward of rank 1's two All-to-Alls, and rank 1 went on to FSDP2's reduce-scatter while
rank 0 waited in the All-to-All (and each waited for the other until the group timeout).

Here the routing biases are set so that this happens in every step: MoE layer 1 sends every token to
ep rank 0's experts, layer 2 to ep rank 1's, layer 3 routes freely. Both FSDP2xEP2 and EP2xTP2 must
then train 4 steps and end with the parameters of one process (so the empty rank's experts got a
zero gradient, not a skipped one). With the old grouped product this test fails on the group timeout.
"""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native import equivalence
from latentmoe_lab.native.equivalence import EquivalenceSettings, check_layouts
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.ops.routing import grouped_matmul, grouped_matmul_reference

# With these biases a layer's chosen experts all live on one ep rank (experts 0-3: rank 0, 4-7: rank 1).
FAVOURED_HALF = {1: 0, 2: 1}  # MoE layer index -> the ep rank (of 2) that gets every token
STEPS = 4  # today's equivalence tests run 3


def write_one_sided_checkpoint(settings, directory):
    """equivalence.write_reference_checkpoint, with routing biases that leave one ep rank without rows."""
    torch.manual_seed(settings.seed)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(settings.preset)).to(getattr(torch, settings.dtype))
    for index, block in enumerate(model.layers):
        if isinstance(block.ffn, LatentMoE) and index in FAVOURED_HALF:
            half = block.ffn.num_experts // 2
            start = FAVOURED_HALF[index] * half
            # sigmoid scores lie in (0, 1): a +1 bias wins every comparison, and a few steps of bias updates
            # (1e-3 each) cannot undo it
            block.ffn.correction_bias[start:start + half] = 1.0
    model.save_pretrained(directory)
    return model


def test_empty_grouped_product_stays_in_the_graph():
    """No rows in, [0, D_out] out, connected to x and w like the reference twin (w's gradient: zeros)."""
    x = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(4, 8, 16, requires_grad=True)
    offsets = torch.zeros(4, dtype=torch.int64)
    out = grouped_matmul(x, w, offsets)
    assert out.shape == (0, 16) and out.grad_fn is not None
    out.sum().backward()
    fast_grad, w.grad = w.grad, None
    grouped_matmul_reference(x, w, offsets).sum().backward()
    assert fast_grad is not None and torch.equal(fast_grad, w.grad)
    assert torch.equal(fast_grad, torch.zeros_like(w))


def test_the_biases_leave_one_ep_rank_without_rows(tmp_path):
    """The premise of the next test: in layers 1 and 2 every pair goes to one half of the experts."""
    settings = EquivalenceSettings(steps=1)
    model = write_one_sided_checkpoint(settings, tmp_path)
    with torch.no_grad():
        model(equivalence.training_batches(model.config, settings)[0])
    for index, rank in FAVOURED_HALF.items():
        counts = model.layers[index].ffn.last_expert_counts
        half = counts.numel() // 2
        other = slice(half, None) if rank == 0 else slice(0, half)
        assert int(counts.sum()) > 0 and int(counts[other].sum()) == 0, (index, counts.tolist())


def test_one_sided_routing_trains_under_fsdp2_ep2_and_ep2_tp2(monkeypatch):
    monkeypatch.setattr(equivalence, "write_reference_checkpoint", write_one_sided_checkpoint)
    # timeout_s: the ranks' group timeout is half of it, so a deadlock ends this test in ~20 s
    settings = EquivalenceSettings(steps=STEPS, timeout_s=40.0)
    layouts = {"FSDP2xEP2": NativeLayout(dp_shard=2, ep=2), "EP2xTP2": NativeLayout(ep=2, tp=2)}
    reports = dict(zip(layouts, check_layouts(list(layouts.values()), settings)))
    for name, report in reports.items():
        assert len(report.losses) == STEPS, name
        assert report.max_logit_error <= 1e-5, name
        assert report.max_param_error <= 1e-5, (name, report.extra["worst_param"])
        assert report.losses == pytest.approx(report.reference_losses, abs=1e-5), name
