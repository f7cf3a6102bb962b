"""The masked form of sparse attention (ops/sparse_attention_masked.py) against its twin, the gather form:
outputs and gradients on ragged shapes, pads, duplicate and empty selections, and inside the DSA layer."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers import dsa as dsa_layer
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.ops.sparse_attention import select_topk, sparse_attention
from latentmoe_lab.ops.sparse_attention_masked import masked_form_pays, masked_sparse_attention


def _inputs(batch, queries, keys, heads, heads_kv, dim, dim_v, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, dim, generator=generator, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, keys, heads_kv, dim, generator=generator, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, keys, heads_kv, dim_v, generator=generator, dtype=dtype, requires_grad=True)
    return q, k, v


def _outputs_and_grads(attention, q, k, v, indices, scale):
    out = attention(q, k, v, indices, scale=scale)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)  # a gradient that is not uniform
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("batch, queries, keys, heads, heads_kv, dim, dim_v, slots, offset", [
    (1, 1, 1, 1, 1, 3, 2, 1, 0),      # one query, one key
    (2, 5, 13, 4, 2, 6, 5, 4, 8),     # grouped heads, a chunk after 8 cached keys
    (3, 7, 7, 3, 3, 5, 7, 9, 0),      # kk > visible keys: trailing -1 pads
    (2, 9, 20, 2, 1, 8, 4, 6, 11),    # MQA (one key head), ragged everything
])
def test_masked_equals_gather_on_topk_selections(batch, queries, keys, heads, heads_kv, dim, dim_v, slots, offset):
    q, k, v = _inputs(batch, queries, keys, heads, heads_kv, dim, dim_v)
    indices = select_topk(torch.randn(batch, queries, keys, dtype=torch.float64), slots, offset)
    want, want_grads = _outputs_and_grads(sparse_attention, q, k, v, indices, 0.3)
    got, got_grads = _outputs_and_grads(masked_sparse_attention, q, k, v, indices, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, g_got, g_want in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_duplicates_pads_and_empty_rows_weigh_as_in_the_gather_form():
    q, k, v = _inputs(2, 3, 6, 2, 1, 4, 3)
    indices = torch.tensor([[[2, 2, 5, -1], [-1, -1, -1, -1], [0, 1, 0, 0]],
                            [[5, 4, 3, 2], [1, -1, 1, -1], [3, 3, 3, 3]]])
    want, want_grads = _outputs_and_grads(sparse_attention, q, k, v, indices, None)
    got, got_grads = _outputs_and_grads(masked_sparse_attention, q, k, v, indices, None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))  # nothing selected: zeros, not NaN
    for g_got, g_want in zip(got_grads, want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


def test_fp32_and_value_view_of_keys():
    """The absorbed layout: V is a view of K's leading channels, as the DSA layer passes it."""
    q, k, _ = _inputs(3, 6, 11, 3, 1, 10, 8, dtype=torch.float32, seed=1)
    indices = select_topk(torch.randn(3, 6, 11), 5, 5)
    want = sparse_attention(q, k, k[..., :8], indices)
    got = masked_sparse_attention(q, k, k[..., :8], indices)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (lambda i: i.float(), "indices: expected an integer dtype"),
    (lambda i: i[:, :, None], r"indices: expected shape \[B, T, kk\]"),
    (lambda i: i.clamp(max=3) + 9, r"indices: values must lie in \[-1, S-1\]"),
    (lambda i: i - 5, r"indices: values must lie in \[-1, S-1\]"),
])
def test_bad_indices_are_refused_by_name(bad, match):
    q, k, v = _inputs(1, 2, 4, 1, 1, 3, 3)
    indices = torch.tensor([[[0, 1], [2, 3]]])
    with pytest.raises((TypeError, ValueError), match=match):
        masked_sparse_attention(q, k, v, bad(indices))


def test_the_choice_of_form():
    assert masked_form_pays(128, 64) and masked_form_pays(256, 64)
    assert not masked_form_pays(4096, 64)


@pytest.mark.parametrize("seq_len", [37, 64])
def test_dsa_layer_masked_form_equals_gather_form(seq_len, monkeypatch):
    """The tiny DSA layer on rows longer than its top-k: forward and gradients of every weight agree whichever
    form attends (the gather form forced by declining the masked one)."""
    config = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    layer = GatedDSA(config).double()
    assert masked_form_pays(seq_len, layer.topk) and seq_len > layer.topk
    x = torch.randn(2, seq_len, config.hidden_size, dtype=torch.float64)

    def run():
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}

    masked_out, masked_grads = run()
    monkeypatch.setattr(dsa_layer, "masked_form_pays", lambda num_keys, slots: False)
    gather_out, gather_grads = run()
    torch.testing.assert_close(masked_out, gather_out, rtol=1e-10, atol=1e-12)
    assert masked_grads.keys() == gather_grads.keys() and masked_grads
    for name in gather_grads:
        torch.testing.assert_close(masked_grads[name], gather_grads[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
