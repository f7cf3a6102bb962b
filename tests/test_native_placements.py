"""native/placements.py: the DTensor placement table notebook 04 §8 prints, read from a real 2-process TP2 build."""
import math

import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.native.placements import NOT_A_DTENSOR, parameter_placements


@pytest.fixture(scope="module")
def tp2():
    return parameter_placements(NativeLayout(tp=2), timeout_s=120.0)


def test_every_parameter_is_listed_with_its_global_shape(tp2):
    with torch.device("meta"):
        model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: r.global_shape for n, r in tp2.items()}


def test_column_and_row_parallel_weights_are_sharded_over_tp(tp2):
    q, o = tp2["layers.1.attn.q_proj.weight"], tp2["layers.1.attn.o_proj.weight"]
    assert (q.placements, q.mesh_dims, q.grad_placements) == ("(Shard(dim=0),)", ("tp",), "(Shard(dim=0),)")
    assert q.local_shape == (q.global_shape[0] // 2, q.global_shape[1])
    assert o.placements == "(Shard(dim=1),)" and o.local_shape == (o.global_shape[0], o.global_shape[1] // 2)


def test_replicated_parameters_inside_a_tp_region_get_partial_gradients(tp2):
    # REPLICATED_SUM (per-head norms) and Sections (the short conv): whole on each rank, gradient a partial sum
    for name in ("layers.1.attn.o_norm.weight", "layers.1.attn.conv.weight", "layers.3.attn.kv_norm.weight"):
        row = tp2[name]
        assert (row.placements, row.grad_placements) == ("(Replicate(),)", "(Partial(sum),)"), name
        assert row.local_shape == row.global_shape


def test_parameters_outside_the_plans_stay_plain_tensors(tp2):
    for name in ("layers.1.ffn.router.weight", "layers.1.ffn.experts.w13", "embed_tokens.weight"):
        row = tp2[name]
        assert (row.placements, row.mesh_dims, row.grad_placements) == (NOT_A_DTENSOR, (), NOT_A_DTENSOR)
        assert row.local_shape == row.global_shape


def test_local_shards_add_up_to_the_global_tensor(tp2):
    for name, row in tp2.items():
        parts = 2 if "Shard" in row.placements else 1
        assert math.prod(row.local_shape) * parts == math.prod(row.global_shape), name


@pytest.mark.parametrize("layout, rank, message", [(NativeLayout(), 0, "at least 2 processes"),
                                                   (NativeLayout(pp=2), 0, "pp = 2"),
                                                   (NativeLayout(tp=2), 2, "rank: must be an integer in")])
def test_bad_arguments_are_refused_before_any_launch(layout, rank, message):
    with pytest.raises(ValueError, match=message):
        parameter_placements(layout, rank=rank)
