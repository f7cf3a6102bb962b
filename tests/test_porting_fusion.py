"""FX passes on exported blocks (latentmoe_lab.porting.fusion): each pass rewrites, cuts nodes or launches, and keeps
the block's outputs to 1e-6 (fp32) on ragged prefill and decode shapes."""
import pytest
import torch

from latentmoe_lab.porting.fusion import PASSES, count_launches, count_nodes, export_block, optimize


@pytest.mark.parametrize("layer, phase, tokens", [(3, "prefill", 37), (1, "decode", 3)])
def test_every_pass_preserves_outputs_and_shrinks_the_graph(model, layer, phase, tokens):
    gm, inputs = export_block(model, layer, phase, tokens)  # T = 37: not a multiple of the KDA chunk (16)
    with torch.no_grad():
        eager = model.layers[layer](*inputs)
    nodes, launches = count_nodes(gm), count_launches(gm)
    report = optimize(gm, inputs, atol=1e-6)  # raises if a pass moves the outputs
    assert [r.name for r in report.results] == [p.__name__ for p in PASSES]
    for result in report.results:
        assert result.rewrites > 0 and result.nodes_after < result.nodes_before, result
        assert result.launches_after < result.launches_before and result.max_abs_diff <= 1e-6
    assert count_nodes(gm) < nodes and count_launches(gm) < launches
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"latentmoe.route_gate.default", "latentmoe.grouped_swiglu.default"} <= targets
    assert "latentmoe.route_topk.default" not in targets
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), eager, rtol=0, atol=1e-6)
    assert "fuse_elementwise" in report.table()


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="phase: must be 'prefill' or 'decode'"):
        export_block(model, 1, "train")
    with pytest.raises(ValueError, match="layer: must be an integer in"):
        export_block(model, 99)
