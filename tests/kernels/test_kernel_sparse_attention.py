"""Gated DSA kernels (latentmoe_kernels.sparse_attention) against index_scores + select_topk and sparse_attention."""
import pytest
import torch

pytest.importorskip("triton")

from latentmoe_lab.ops.sparse_attention import (dense_causal_attention, index_scores, index_topk,  # noqa: E402
                                                select_topk, sparse_attention)


def _dyadic(*shape):
    """Multiples of 1/4 in [-0.75, 0.75]: index scores come out exact in fp32 whatever the summation
    order, so ties (frequent after ReLU) are real ties and the selected positions must match exactly."""
    return torch.randint(-3, 4, shape).float() / 4


@pytest.mark.parametrize("batch, queries, keys, heads, dim, k, offset", [
    (2, 3, 11, 3, 60, 4, 8),     # chunk after 8 cached tokens, DI = 60
    (1, 1, 20, 2, 64, 8, 19),    # one decode query seeing every key
    (1, 4, 6, 2, 16, 8, 0),      # fewer visible positions than k (and k > S): -1 padding
    (1, 1, 150, 2, 16, 129, 149),  # k = 129 -> KP = 256 keys per block, scored in two 128-key pieces
])
def test_index_topk_matches_select_topk_of_index_scores(batch, queries, keys, heads, dim, k, offset):
    q_idx, k_idx, w = _dyadic(batch, queries, heads, dim), _dyadic(batch, keys, dim), _dyadic(batch, queries, heads)
    expected = select_topk(index_scores(q_idx, k_idx, w), k, offset)
    assert torch.equal(index_topk(q_idx, k_idx, w, k, offset, backend="triton"), expected)


@pytest.mark.parametrize("queries, keys, k, offset", [(5, 12, 4, 7), (1, 150, 129, 149), (4, 6, 8, 0)])
def test_index_topk_with_first_key_matches_the_torch_path(queries, keys, k, offset):
    """Packed sequences: each query's earliest visible key, some past every visible key (all -1)."""
    q_idx, k_idx, w = _dyadic(2, queries, 3, 16), _dyadic(2, keys, 16), _dyadic(2, queries, 3)
    first_key = torch.randint(0, offset + queries + 1, (2, queries))
    first_key[0, 0] = 0
    first_key[1, -1] = offset + queries  # beyond the last visible key of that query
    expected = index_topk(q_idx, k_idx, w, k, offset, first_key, backend="torch")
    assert torch.equal(index_topk(q_idx, k_idx, w, k, offset, first_key, backend="triton"), expected)
    assert torch.all(expected[1, -1] == -1)


@pytest.mark.parametrize("heads, heads_kv, dim, dim_v", [
    (4, 2, 60, 64),
    (3, 1, 64, 60),
    (40, 1, 16, 512),  # wide values: 16 heads per program, so three head blocks (16, 16, 8)
])
def test_sparse_attention_kernel_matches_reference(heads, heads_kv, dim, dim_v):
    batch, queries, keys, selected = 2, 5, 9, 6
    q = torch.randn(batch, queries, heads, dim)
    k, v = torch.randn(batch, keys, heads_kv, dim), torch.randn(batch, keys, heads_kv, dim_v)
    indices = torch.stack([torch.randperm(keys)[:selected] for _ in range(batch * queries)]).view(batch, queries, -1)
    indices[0, 1, 2:] = -1  # only two positions selected
    indices[1, 3] = -1      # nothing selected: the output is 0
    out = sparse_attention(q, k, v, indices, scale=0.3, backend="triton")
    torch.testing.assert_close(out, sparse_attention(q, k, v, indices, scale=0.3, backend="torch"))
    assert torch.all(out[1, 3] == 0)


def test_selection_then_attention_equals_dense_causal_when_k_covers_the_context():
    batch, queries, keys, heads, dim = 1, 4, 7, 2, 16
    offset = keys - queries
    q_idx, k_idx, w = _dyadic(batch, queries, 2, dim), _dyadic(batch, keys, dim), _dyadic(batch, queries, 2)
    indices = index_topk(q_idx, k_idx, w, keys, offset, backend="triton")
    q, k, v = torch.randn(batch, queries, heads, dim), torch.randn(batch, keys, 1, dim), torch.randn(batch, keys, 1, dim)
    out = sparse_attention(q, k, v, indices, backend="triton")
    torch.testing.assert_close(out, dense_causal_attention(q, k, v, offset=offset))


def test_sparse_attention_kernel_16_bit():
    # fp16, not bf16: numpy has no bfloat16, and the interpreter's tl.dot multiplies raw bf16 bits.
    q = torch.randn(1, 3, 2, 32, dtype=torch.float16)
    k, v = torch.randn(1, 8, 1, 32, dtype=torch.float16), torch.randn(1, 8, 1, 32, dtype=torch.float16)
    indices = torch.tensor([[[0, 1, 2, 3], [4, 5, -1, -1], [7, 6, 5, 0]]])
    out = sparse_attention(q, k, v, indices, backend="triton")
    assert out.dtype == torch.float16
    expected = sparse_attention(q.float(), k.float(), v.float(), indices, backend="torch")
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_bf16_is_refused_in_the_interpreter():
    q = torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q: bfloat16"):
        sparse_attention(q, q, q, torch.zeros(1, 1, 1, dtype=torch.long), backend="triton")
