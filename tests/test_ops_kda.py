"""KDA ops: the chunked form matches the per-token recurrence; the recurrence matches the formula."""
import re

import pytest
import torch

from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.norms import l2_norm


def make_inputs(batch, seq_len, heads, dim_k, dim_v, seed=0, strong_decay_at=()):
    """Random KDA inputs as the layer produces them: unit-norm k, g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim_k, generator=gen)
    k = l2_norm(torch.randn(batch, seq_len, heads, dim_k, generator=gen))
    v = torch.randn(batch, seq_len, heads, dim_v, generator=gen)
    g = -0.5 * torch.rand(batch, seq_len, heads, dim_k, generator=gen)
    for t in strong_decay_at:
        g[:, t, 0] = -1000.0  # a full reset of head 0 at token t
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    state = torch.randn(batch, heads, dim_k, dim_v, generator=gen)
    return q, k, v, g, beta, state


CASES = [  # (T, chunk_size, K, V)
    (1, 64, 16, 16),
    (63, 64, 16, 16),
    (64, 64, 60, 16),
    (200, 64, 16, 60),
    (200, 48, 60, 60),  # 48 does not divide 200
    (37, 8, 16, 60),
]


@pytest.mark.parametrize("seq_len,chunk_size,dim_k,dim_v", CASES)
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_matches_recurrent(seq_len, chunk_size, dim_k, dim_v, with_initial_state):
    q, k, v, g, beta, state = make_inputs(2, seq_len, 3, dim_k, dim_v, strong_decay_at=[t for t in (0, 5, 130)
                                                                                          if t < seq_len])
    initial = state if with_initial_state else None
    ref_out, ref_state = kda_recurrent(q, k, v, g, beta, initial_state=initial, output_final_state=True)
    out, final = kda_chunked(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                             chunk_size=chunk_size)
    assert out.shape == (2, seq_len, 3, dim_v) and final.shape == (2, 3, dim_k, dim_v)
    assert final.dtype == torch.float32 and torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_state, rtol=1e-5, atol=1e-5)


def test_explicit_scale_and_low_precision_inputs():
    q, k, v, g, beta, state = make_inputs(1, 20, 2, 16, 8, seed=1)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref_out, ref_state = kda_recurrent(q, k, v, g, beta, scale=0.3, initial_state=state, output_final_state=True)
    out, final = kda_chunked(q, k, v, g, beta, scale=0.3, initial_state=state, output_final_state=True,
                             chunk_size=16)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(final, ref_state, rtol=1e-5, atol=1e-5)


def test_splitting_the_sequence_carries_the_state():
    q, k, v, g, beta, _ = make_inputs(2, 50, 2, 16, 16, seed=2)
    full, full_state = kda_chunked(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    head, mid = kda_chunked(q[:, :21], k[:, :21], v[:, :21], g[:, :21], beta[:, :21],
                            output_final_state=True, chunk_size=16)
    tail, last = kda_chunked(q[:, 21:], k[:, 21:], v[:, 21:], g[:, 21:], beta[:, 21:],
                             initial_state=mid, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, full_state, rtol=1e-5, atol=1e-5)


def test_empty_sequence_and_no_final_state():
    q, k, v, g, beta, state = make_inputs(2, 0, 2, 4, 6)
    for op in (kda_recurrent, kda_chunked):
        out, final = op(q, k, v, g, beta, initial_state=state, output_final_state=True)
        assert out.shape == (2, 0, 2, 6)
        torch.testing.assert_close(final, state)
        assert op(q, k, v, g, beta)[1] is None


def test_gradients_are_finite_with_hard_resets():
    q, k, v, g, beta, state = make_inputs(1, 40, 2, 8, 8, seed=3, strong_decay_at=[3, 17])
    tensors = [t.requires_grad_() for t in (q, k, v, g, beta, state)]
    out, final = kda_chunked(*tensors[:5], initial_state=tensors[5], output_final_state=True, chunk_size=16)
    (out.sum() + final.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in tensors)


def test_recurrence_by_hand():
    """T=2, H=1, K=V=2, written out with plain numbers."""
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    k = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    v = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    g = torch.log(torch.tensor([[0.5, 0.25], [1.0, 0.5]]))
    beta = torch.tensor([0.5, 1.0])
    s0 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    scale = 2 ** -0.5

    # t = 0: S' = diag(0.5, 0.25) S0 = [[0.5, 0], [0, 0.5]]; S'^T k = (0.3, 0.4)
    # write = 0.5 * ((1, 2) - (0.3, 0.4)) = (0.35, 0.8); S1 = S' + k write^T
    s1 = torch.tensor([[0.5 + 0.6 * 0.35, 0.6 * 0.8], [0.8 * 0.35, 0.5 + 0.8 * 0.8]])
    o0 = scale * s1[0]  # q_0 = e_0 picks the first row of S1
    # t = 1: S' = diag(1, 0.5) S1; k = e_0 so S'^T k is the first row of S'
    s1_decayed = torch.tensor([[1.0], [0.5]]) * s1
    write = 1.0 * (v[1] - s1_decayed[0])
    s2 = s1_decayed + torch.outer(k[1], write)
    o1 = scale * 0.5 * (s2[0] + s2[1])
    expected_out = torch.stack([o0, o1])

    out, final = kda_recurrent(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                               beta[None, :, None], initial_state=s0[None, None], output_final_state=True)
    torch.testing.assert_close(out[0, :, 0], expected_out)
    torch.testing.assert_close(final[0, 0], s2)
    # the written-out numbers for t = 0
    torch.testing.assert_close(s1, torch.tensor([[0.71, 0.48], [0.28, 1.14]]))


def test_validation_names_the_argument():
    q, k, v, g, beta, state = make_inputs(1, 4, 2, 4, 4)
    bad_calls = {
        "q: expected 4 dims": dict(q=q[0]),
        "k: expected the shape of q": dict(k=k[:, :3]),
        "g: expected the shape of q": dict(g=g[..., :3]),
        "v: expected [B, T, H]": dict(v=v[:, :, :1]),
        "beta: expected shape": dict(beta=beta[..., None]),
        "initial_state: expected shape": dict(initial_state=state[:, :, :3]),
        "scale: expected a finite positive": dict(scale=-1.0),
    }
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    for message, change in bad_calls.items():
        for op in (kda_recurrent, kda_chunked):
            with pytest.raises(ValueError, match=re.escape(message)):
                op(**{**base, **change})
    with pytest.raises(TypeError, match="v: expected a floating-point dtype"):
        kda_chunked(**{**base, "v": v.long()})
    with pytest.raises(TypeError, match="beta: expected a torch.Tensor"):
        kda_recurrent(**{**base, "beta": 0.5})
    with pytest.raises(ValueError, match="chunk_size: expected a positive integer"):
        kda_chunked(**base, chunk_size=0)
