"""kda_chunked's intra-chunk form against the recurrence: both gate forms, odd chunk sizes, gradients,
hard resets and deep decays (blocks halved down to single tokens), and chunk groups."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.norms import l2_norm


def layer_inputs(gate_form: str, seq_len: int, seed: int = 0):
    """q, k, v, g, beta and a state as KimiDeltaAttention makes them; large x drives the gates to extremes."""
    config = ModelConfig.from_preset("tiny")
    config = config.replace(kda={**config.to_dict()["kda"], "gate_form": gate_form})
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config)
    x = 4.0 * torch.randn(2, seq_len, config.hidden_size)
    heads, dim = config.kda.num_heads, config.kda.head_dim_k
    with torch.no_grad():
        g = layer.forget_gate(x)
    q = torch.randn(2, seq_len, heads, dim)
    k = l2_norm(torch.randn(2, seq_len, heads, dim))
    v = torch.randn(2, seq_len, heads, config.kda.head_dim_v)
    beta = torch.rand(2, seq_len, heads)
    state = torch.randn(2, heads, dim, config.kda.head_dim_v)
    return q, k, v, g, beta, state


def assert_matches_recurrence(q, k, v, g, beta, state=None, chunk_size=64):
    """kda_chunked's output and final state equal kda_recurrent's to 1e-5."""
    ref_out, ref_state = kda_recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True)
    out, final = kda_chunked(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate_form", ["lower_bound", "softplus"])
@pytest.mark.parametrize("seq_len,chunk_size", [(45, 16), (100, 64), (33, 7), (50, 12)])
def test_chunked_matches_recurrent_for_both_gate_forms(gate_form, seq_len, chunk_size):
    q, k, v, g, beta, state = layer_inputs(gate_form, seq_len)
    if gate_form == "softplus":
        assert g.min() < -8  # the unbounded form really goes below the other form's floor of -5
    else:
        assert g.min() >= -5.0
    g[:, seq_len // 2, 1] = -1000.0  # and one hard reset of head 1
    assert_matches_recurrence(q, k, v, g, beta, state, chunk_size=chunk_size)


def test_many_resets_close_together_stay_exact():
    """Resets push the cumulative decay to -1000s; pairs after the last reset still need fp32-exact gaps."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 70, 1, 8, generator=gen), l2_norm(torch.randn(1, 70, 1, 8, generator=gen))
    v, beta = torch.randn(1, 70, 1, 8, generator=gen), torch.rand(1, 70, 1, generator=gen)
    g = -1e-3 * torch.rand(1, 70, 1, 8, generator=gen)
    g[:, [1, 2, 9, 10, 40, 64]] = -1000.0
    assert_matches_recurrence(q, k, v, g, beta, chunk_size=64)


@pytest.mark.parametrize("safe_growth", [1e20, 1.0], ids=["default", "every-block-halved"])
def test_gradients_match_the_recurrence(monkeypatch, safe_growth):
    monkeypatch.setattr("latentmoe_lab.ops.kda_intra.SAFE_GROWTH", safe_growth)
    q, k, v, g, beta, state = layer_inputs("softplus", 40, seed=1)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    twins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    out, final = kda_chunked(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=16)
    (out.square().sum() + final.sum()).backward()
    ref_out, ref_final = kda_recurrent(*twins[:5], initial_state=twins[5], output_final_state=True)
    (ref_out.square().sum() + ref_final.sum()).backward()
    for mine, reference in zip(inputs, twins):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk_size", [64, 50, 7])
def test_blocks_halved_down_to_pairwise_blocks(monkeypatch, chunk_size):
    """SAFE_GROWTH = 1 lets no decaying block grow its keys: every chunk is halved down to the pairwise form."""
    monkeypatch.setattr("latentmoe_lab.ops.kda_intra.SAFE_GROWTH", 1.0)
    q, k, v, g, beta, state = layer_inputs("lower_bound", 130, seed=6)
    assert_matches_recurrence(q, k, v, g, beta, state, chunk_size=chunk_size)


@pytest.mark.parametrize("group_rows", [1, 100, 10_000])
def test_chunk_groups_carry_the_state(monkeypatch, group_rows):
    """Groups of one chunk, of a few chunks with a ragged last group, and one group for everything agree."""
    q, k, v, g, beta, state = layer_inputs("softplus", 150, seed=4)
    g[:, 70, 0] = -1000.0
    monkeypatch.setattr("latentmoe_lab.ops.kda.GROUP_ROWS", group_rows)
    assert_matches_recurrence(q, k, v, g, beta, state, chunk_size=16)


def test_one_deep_channel_halves_only_its_chunk():
    """One channel of tokens 16..31 decays past 1 / SAFE_GROWTH without any single huge step; the rest stays mild."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 64, 2, 8, generator=gen), l2_norm(torch.randn(1, 64, 2, 8, generator=gen))
    v, beta = torch.randn(1, 64, 2, 8, generator=gen), torch.rand(1, 64, 2, generator=gen)
    g = -0.05 * torch.rand(1, 64, 2, 8, generator=gen)
    g[:, 16:32, 0, 3] = -3.5  # 16 x 3.5 = 56 nats > log(SAFE_GROWTH) = 46 in one channel
    assert_matches_recurrence(q, k, v, g, beta, chunk_size=64)
