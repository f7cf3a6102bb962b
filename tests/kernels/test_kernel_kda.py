"""KDA kernels (latentmoe_kernels.kda) against the per-token reference kda_recurrent(backend="torch")."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent  # noqa: E402


def _inputs(batch, seq_len, heads, dim_k, dim_v, dtype=torch.float32):
    q = F.normalize(torch.randn(batch, seq_len, heads, dim_k), dim=-1)
    k = F.normalize(torch.randn(batch, seq_len, heads, dim_k), dim=-1)
    v = torch.randn(batch, seq_len, heads, dim_v)
    g = -torch.rand(batch, seq_len, heads, dim_k) * 0.5
    beta = torch.rand(batch, seq_len, heads)
    state = torch.randn(batch, heads, dim_k, dim_v)
    return [t.to(dtype) for t in (q, k, v, g, beta)], state


@pytest.mark.parametrize("seq_len, dim_k, dim_v, with_state", [
    (37, 60, 64, True),   # T not a multiple of the chunk, K = 60 pads to 64, V split in two blocks
    (1, 64, 60, False),   # one token
    (20, 16, 16, True),
])
def test_chunked_kernel_matches_reference(seq_len, dim_k, dim_v, with_state):
    (q, k, v, g, beta), state = _inputs(1, seq_len, 2, dim_k, dim_v)
    if seq_len > 5:
        g[:, 5] = -1000.0  # a full reset in the middle of the first chunk
    initial = state if with_state else None
    ref_out, ref_state = kda_recurrent(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                       backend="torch")
    out, final = kda_chunked(q, k, v, g, beta, initial_state=initial, output_final_state=True, chunk_size=16,
                             backend="triton")
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, ref_state, rtol=1e-4, atol=1e-5)


def test_chunked_kernel_all_decay_minus_1000_and_no_final_state():
    (q, k, v, _, beta), state = _inputs(2, 19, 1, 32, 32)
    g = torch.full_like(q, -1000.0)
    ref_out, _ = kda_recurrent(q, k, v, g, beta, initial_state=state, backend="torch")
    out, final = kda_chunked(q, k, v, g, beta, initial_state=state, chunk_size=16, backend="triton")
    assert final is None and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_chunked_kernel_rounds_chunk_size_to_its_tile():
    (q, k, v, g, beta), _ = _inputs(1, 21, 1, 16, 16)
    ref_out, _ = kda_recurrent(q, k, v, g, beta, backend="torch")
    out, _ = kda_chunked(q, k, v, g, beta, chunk_size=5, backend="triton")  # runs with 16-token chunks
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seq_len, dim_k, dim_v", [(1, 60, 64), (5, 64, 60)])
def test_recurrent_kernel_advances_the_state_in_place(seq_len, dim_k, dim_v):
    (q, k, v, g, beta), state = _inputs(2, seq_len, 2, dim_k, dim_v)
    g[:, 0, 0] = -1000.0
    ref_out, ref_state = kda_recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                       backend="torch")
    cache_state = state.clone()
    out, final = kda_recurrent(q, k, v, g, beta, initial_state=cache_state, output_final_state=True,
                               backend="triton")
    assert final is cache_state  # the decode path writes the cache's own tensor
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache_state, ref_state, rtol=1e-4, atol=1e-5)


def test_kernels_take_bf16_and_keep_state_fp32():
    (q, k, v, g, beta), state = _inputs(1, 18, 1, 32, 32, dtype=torch.bfloat16)
    ref_out, ref_state = kda_recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                       backend="torch")
    for run in (lambda: kda_chunked(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=16,
                                    backend="triton"),
                lambda: kda_recurrent(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                                      backend="triton")):
        out, final = run()
        assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(final, ref_state, rtol=1e-4, atol=1e-4)
