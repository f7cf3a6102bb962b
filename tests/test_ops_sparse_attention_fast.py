"""The fast paths of the sparse-attention ops against their plain twins.

select_topk (threshold + tie rule) against select_topk_reference (one stable sort per row); sparse_attention
with V a view of K's leading channels (absorbed MLA, one gather) against the same V as its own tensor.
"""
import pytest
import torch

from latentmoe_lab.ops.sparse_attention import (index_scores, select_topk, select_topk_reference,
                                                sparse_attention)


@pytest.mark.parametrize("seed", range(4))
def test_fast_selection_equals_the_stable_sort_on_tie_heavy_scores(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        batch, queries, keys = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 3), (1, 9), (1, 40)))
        k = int(torch.randint(1, 45, (1,), generator=gen))
        offset = int(torch.randint(0, 12, (1,), generator=gen))
        scores = torch.randint(-2, 3, (batch, queries, keys), generator=gen).float().relu()  # many exact zeros
        scores[..., ::5] = float("-inf")  # visible -inf scores must still beat invisible keys
        expected = select_topk_reference(scores, k, offset)
        assert torch.equal(select_topk(scores, k, offset), expected)
        assert torch.equal(select_topk(scores.double(), k, offset), expected)


def test_no_keys_and_no_queries():
    assert torch.equal(select_topk(torch.empty(2, 3, 0), 4), torch.full((2, 3, 4), -1))
    assert select_topk(torch.empty(2, 0, 5), 4).shape == (2, 0, 4)
    assert torch.equal(select_topk(torch.empty(2, 3, 0), 4), select_topk_reference(torch.empty(2, 3, 0), 4))


def test_reference_validates_like_the_fast_op():
    with pytest.raises(ValueError, match="k: must be >= 1"):
        select_topk_reference(torch.randn(1, 2, 3), 0)
    with pytest.raises(ValueError, match=r"scores: expected 3 dims"):
        select_topk(torch.randn(2, 3), 2)


def test_values_that_are_the_leading_channels_of_the_keys_give_the_same_attention():
    gen = torch.Generator().manual_seed(5)
    latent_rope = torch.randn(2, 40, 1, 12, generator=gen)  # [c_kv (8) | rope (4)] per key, one shared head
    q = torch.randn(2, 6, 3, 12, generator=gen)
    scores = index_scores(torch.randn(2, 6, 2, 5, generator=gen), torch.randn(2, 40, 5, generator=gen),
                          torch.rand(2, 6, 2, generator=gen))
    indices = select_topk(scores, 7, offset=34)
    shared = sparse_attention(q, latent_rope, latent_rope[..., :8], indices)
    separate = sparse_attention(q, latent_rope, latent_rope[..., :8].clone(), indices)
    torch.testing.assert_close(shared, separate)
    assert shared.shape == (2, 6, 3, 8)
