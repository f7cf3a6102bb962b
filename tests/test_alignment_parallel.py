"""An N-rank layout's taps, gathered across ranks, carry the single-process names and values."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.alignment import ExpertChoice, ParallelCandidate, compare, record, tap_points
from latentmoe_lab.parallel.config import ParallelConfig


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


@pytest.mark.parametrize("layout", ["EP2", "PP2"])
def test_rank_taps_gather_to_the_single_process_names_and_values(model, tiny_config, layout):
    """EP2: each rank runs half the rows (batch shards are concatenated); PP2: each stage holds half the
    layers (stages are merged); either way every tap of one process comes back, equal to it."""
    ids = torch.randint(0, tiny_config.vocab_size, (4, 29))
    single = record(model, ids)
    gathered = record(ParallelCandidate(model, ParallelConfig.from_layout(layout)), ids)
    assert gathered.names() == [p.name for p in tap_points(tiny_config)] == single.names()
    for name in single.names():
        ref, got = single[name], gathered[name]
        if isinstance(ref, ExpertChoice):
            assert torch.equal(ref.indices, got.indices), name
            torch.testing.assert_close(got.weights, ref.weights, rtol=0, atol=1e-6)
        else:
            assert got.shape == ref.shape, name
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    report = compare(model, ParallelCandidate(model, ParallelConfig(ep=2)), ids[:2, :9])
    assert report.first_divergence is None and report.candidate_name == "EP2"


def test_layouts_that_split_the_token_axis_are_refused(model):
    with pytest.raises(ValueError, match="taps are gathered for ep / tp / pp / dp"):
        ParallelCandidate(model, ParallelConfig(cp=2))
    with pytest.raises(ValueError, match="at least 2 processes"):
        ParallelCandidate(model, ParallelConfig())
    with pytest.raises(ValueError, match="divisible by dp\\*ep"):
        record(ParallelCandidate(model, ParallelConfig(ep=2)), torch.zeros(3, 8, dtype=torch.int64))
