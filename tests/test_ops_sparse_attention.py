"""Reference ops of DeepSeek Sparse Attention: indexer scores, causal top-k, sparse vs dense attention."""
import pytest
import torch

from latentmoe_lab.ops.sparse_attention import (dense_causal_attention, index_scores, index_topk, select_topk,
                                                sparse_attention)


def test_index_scores_matches_explicit_loop():
    torch.manual_seed(0)
    B, T, S, HI, DI = 2, 3, 5, 2, 4
    q_idx, k_idx, w = torch.randn(B, T, HI, DI), torch.randn(B, S, DI), torch.randn(B, T, HI)
    expected = torch.zeros(B, T, S)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                for j in range(HI):
                    expected[b, t, s] += w[b, t, j] * torch.relu(q_idx[b, t, j] @ k_idx[b, s])
    got = index_scores(q_idx.bfloat16(), k_idx.bfloat16(), w.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(index_scores(q_idx, k_idx, w), expected)
    torch.testing.assert_close(got, expected, atol=0.15, rtol=0.05)


def _true_topk_sets(scores, k, offset):
    """Per (b, t): the set of the k best visible positions, by an explicit sort."""
    B, T, _ = scores.shape
    return [[set(torch.argsort(scores[b, t, : t + offset + 1], descending=True)[:k].tolist())
             for t in range(T)] for b in range(B)]


@pytest.mark.parametrize("T,S,k,offset", [(6, 6, 3, 0), (4, 9, 4, 5), (5, 7, 10, 2), (1, 1, 2, 0)])
def test_select_topk_is_causal_padded_and_exact(T, S, k, offset):
    torch.manual_seed(1)
    scores = torch.randn(2, T, S)
    sel = select_topk(scores, k, offset)
    assert sel.shape == (2, T, k) and sel.dtype == torch.int64
    truth = _true_topk_sets(scores, k, offset)
    for b in range(2):
        for t in range(T):
            row = sel[b, t].tolist()
            num_visible = min(t + offset + 1, S)
            num_kept = min(k, num_visible)
            assert all(s <= t + offset for s in row if s >= 0), "selected a future position"
            assert row[num_kept:] == [-1] * (k - num_kept), "padding must be -1 and come last"
            assert set(row[:num_kept]) == truth[b][t]


def test_select_topk_keeps_a_visible_minus_inf_over_masked_positions():
    scores = torch.tensor([[[float("-inf"), 0.5, 2.0]]]).expand(1, 2, 3).clone()
    sel = select_topk(scores, 3, offset=0)
    assert sel[0, 0].tolist() == [0, -1, -1]
    assert sorted(sel[0, 1].tolist()) == [-1, 0, 1]


def test_select_topk_breaks_ties_towards_earlier_positions_whatever_the_key_count():
    scores = torch.zeros(1, 2, 8)  # all heads ReLU-ed to zero: every visible score ties
    scores[0, 1, 1] = 1.0
    full = select_topk(scores, 3, offset=4)
    assert full[0, 0].tolist() == [0, 1, 2] and full[0, 1].tolist() == [1, 0, 2]
    torch.testing.assert_close(select_topk(scores[:, :, :6], 3, offset=4), full)


def _all_causal(B, T, S, offset):
    return select_topk(torch.randn(B, T, S), S, offset)  # k = S keeps every visible position


@pytest.mark.parametrize("heads_kv", [1, 2, 4])
@pytest.mark.parametrize("T,S,offset", [(5, 7, 2), (1, 9, 8), (6, 6, 0), (3, 8, 2)])
def test_sparse_with_every_causal_position_equals_dense(heads_kv, T, S, offset):
    torch.manual_seed(2)
    B, H, D, DV = 2, 4, 6, 5
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, S, heads_kv, D), torch.randn(B, S, heads_kv, DV)
    indices = _all_causal(B, T, S, offset)
    out = sparse_attention(q, k, v, indices)
    assert out.shape == (B, T, H, DV)
    torch.testing.assert_close(out, dense_causal_attention(q, k, v, offset=offset))
    torch.testing.assert_close(sparse_attention(q, k, v, indices, scale=0.3),
                               dense_causal_attention(q, k, v, scale=0.3, offset=offset))


def test_sparse_attention_on_a_subset_matches_explicit_softmax():
    torch.manual_seed(3)
    B, T, S, H, D, DV = 2, 3, 6, 4, 5, 3
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, S, 2, D), torch.randn(B, S, 2, DV)
    indices = torch.randint(-1, S, (B, T, 4))
    indices[0, 0] = torch.tensor([3, -1, 0, -1])
    out = sparse_attention(q, k, v, indices)
    for b in range(B):
        for t in range(T):
            chosen = [s for s in indices[b, t].tolist() if s >= 0]
            for h in range(H):
                g = h // 2  # GQA: consecutive query heads share one key/value head
                if not chosen:
                    expected = torch.zeros(DV)
                else:
                    p = torch.softmax(k[b, chosen, g] @ q[b, t, h] * D ** -0.5, dim=0)
                    expected = p @ v[b, chosen, g]
                torch.testing.assert_close(out[b, t, h], expected)


def test_all_masked_row_gives_zeros_not_nan_and_keeps_dtype():
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 2, 2, 4).bfloat16(), torch.randn(1, 3, 1, 4).bfloat16(), torch.randn(1, 3, 1, 2).bfloat16()
    indices = torch.tensor([[[-1, -1], [0, 2]]])
    out = sparse_attention(q, k, v, indices)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert (out[0, 0] == 0).all() and (out[0, 1] != 0).any()


def test_validation_errors_name_the_argument():
    q, k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 5, 2, 3), torch.randn(1, 5, 2, 2)
    good = torch.zeros(1, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"q: expected 4 dims"):
        sparse_attention(q[0], k, v, good)
    with pytest.raises(ValueError, match=r"k: key/value heads \(HKV=3\) must divide"):
        sparse_attention(q, torch.randn(1, 5, 3, 3), torch.randn(1, 5, 3, 2), good)
    with pytest.raises(ValueError, match=r"k: last dim"):
        sparse_attention(q, torch.randn(1, 5, 2, 4), v, good)
    with pytest.raises(ValueError, match=r"v: dims \[S, HKV\]"):
        sparse_attention(q, k, torch.randn(1, 4, 2, 2), good)
    with pytest.raises(ValueError, match=r"k: batch size"):
        sparse_attention(q, k.expand(2, -1, -1, -1), v, good)
    with pytest.raises(ValueError, match=r"indices: values must lie in \[-1, S-1\]"):
        sparse_attention(q, k, v, good + 5)
    with pytest.raises(ValueError, match=r"indices: values must lie"):
        sparse_attention(q, k, v, good - 2)
    with pytest.raises(TypeError, match=r"indices: expected an integer dtype"):
        sparse_attention(q, k, v, good.float())
    with pytest.raises(ValueError, match=r"indices: leading dims"):
        sparse_attention(q, k, v, torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"scale: must be a positive number"):
        sparse_attention(q, k, v, good, scale=-1.0)
    with pytest.raises(ValueError, match=r"k: must be >= 1"):
        select_topk(torch.randn(1, 2, 3), 0)
    with pytest.raises(ValueError, match=r"offset: must be >= 0"):
        select_topk(torch.randn(1, 2, 3), 2, offset=-1)
    with pytest.raises(TypeError, match=r"k: expected an int"):
        select_topk(torch.randn(1, 2, 3), 2.0)
    with pytest.raises(ValueError, match=r"scores: expected 3 dims"):
        select_topk(torch.randn(2, 3), 2)
    with pytest.raises(ValueError, match=r"k_idx: last dim \(DI=5\)"):
        index_scores(torch.randn(1, 2, 2, 4), torch.randn(1, 3, 5), torch.randn(1, 2, 2))
    with pytest.raises(ValueError, match=r"w: expected shape \[B, T, HI\]"):
        index_scores(torch.randn(1, 2, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match=r"k_idx: batch size"):
        index_scores(torch.randn(1, 2, 2, 4), torch.randn(2, 3, 4), torch.randn(1, 2, 2))
    with pytest.raises(TypeError, match=r"q_idx: expected a floating-point dtype"):
        index_scores(torch.ones(1, 2, 2, 4, dtype=torch.long), torch.randn(1, 3, 4), torch.randn(1, 2, 2))


def test_index_topk_first_key_keeps_only_the_query_sequence():
    """Two packed sequences [0, 4) and [4, 9): each query's picks are what its sequence alone would pick."""
    torch.manual_seed(0)
    q_idx, k_idx, w = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 8), torch.rand(1, 9, 2)
    first_key = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4, 4]])
    packed = index_topk(q_idx, k_idx, w, 3, first_key=first_key)
    assert torch.equal(index_topk(q_idx, k_idx, w, 3, first_key=torch.zeros_like(first_key)),
                       index_topk(q_idx, k_idx, w, 3))
    alone = index_topk(q_idx[:, 4:], k_idx[:, 4:], w[:, 4:], 3)  # the second sequence on its own
    assert torch.equal(packed[:, 4:], torch.where(alone >= 0, alone + 4, -1))
    assert torch.equal(packed[:, :4], index_topk(q_idx[:, :4], k_idx[:, :4], w[:, :4], 3))
    with pytest.raises(ValueError, match=r"first_key: expected an int64 tensor of shape \[B, T\]"):
        index_topk(q_idx, k_idx, w, 3, first_key=first_key[:, :5])
