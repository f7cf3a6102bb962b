"""The KDA training path's fast forms against their plain twins, outputs and gradients on ragged shapes:
the inter-chunk state hand-off (ops/kda_state.py) against its autograd loop, kda_chunked built on it against
the per-token recurrence, and the shifted short conv (ops/short_conv.py) against F.conv1d, alone and in the layer."""
import pytest
import torch

from latentmoe_lab.cache import KDALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.kda import SEQUENCE_START_DECAY, KimiDeltaAttention
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.kda_state import ChunkStates, chunk_states, chunk_states_plain
from latentmoe_lab.ops.norms import l2_norm
from latentmoe_lab.ops.short_conv import causal_depthwise_conv, causal_depthwise_conv_plain


def state_inputs(chunks: int, rows: int, chunk: int, dim: int, gen: torch.Generator, dtype=torch.float32,
                 resets: bool = False):
    """w, u [N, BH, C, d], k_to_end [N, BH, d, C], whole_chunk [N, BH, d] (zeros where a chunk reset), state."""
    w = 0.2 * torch.randn(chunks, rows, chunk, dim, generator=gen, dtype=dtype)
    u = torch.randn(chunks, rows, chunk, dim, generator=gen, dtype=dtype)
    k_to_end = 0.2 * torch.randn(chunks, rows, dim, chunk, generator=gen, dtype=dtype)
    whole_chunk = torch.rand(chunks, rows, dim, generator=gen, dtype=dtype)
    if resets:
        whole_chunk[chunks // 2] = 0.0  # exp(-1000): the state before that chunk is erased
        whole_chunk[..., 0] = 0.0
    state = torch.randn(rows, dim, dim, generator=gen, dtype=dtype)
    return [w, u, k_to_end, whole_chunk, state]


def run_with_grads(fn, inputs, weights, use):
    """fn's three outputs, and the gradients of all five inputs for the loss sum(weight * output) over `use`."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    loss = sum((outputs[i] * weights[i]).sum() for i in use)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outputs], grads


@pytest.mark.parametrize("chunks,rows", [(1, 1), (3, 2), (5, 1)])
@pytest.mark.parametrize("use", [(0, 1, 2), (0, 1), (2,)], ids=["all", "no-final", "final-only"])
@pytest.mark.parametrize("resets", [False, True])
def test_chunk_states_match_the_autograd_loop(chunks, rows, use, resets):
    gen = torch.Generator().manual_seed(chunks * 10 + rows)
    inputs = state_inputs(chunks, rows, chunk=5, dim=6, gen=gen, resets=resets)
    probe = chunk_states_plain(*inputs)
    weights = [torch.randn(o.shape, generator=gen) for o in probe]
    fast_out, fast_grads = run_with_grads(chunk_states, inputs, weights, use)
    plain_out, plain_grads = run_with_grads(chunk_states_plain, inputs, weights, use)
    for fast, plain in zip(fast_out, plain_out):
        torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
    for fast, plain in zip(fast_grads, plain_grads):
        plain = torch.zeros_like(fast) if plain is None else plain  # w, u, ... unused when only S_0 is read
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_chunk_states_gradcheck_in_fp64():
    gen = torch.Generator().manual_seed(7)
    inputs = [t.requires_grad_() for t in state_inputs(3, 2, chunk=3, dim=2, gen=gen, dtype=torch.float64)]
    assert torch.autograd.gradcheck(ChunkStates.apply, inputs)


def kda_inputs(batch, seq_len, heads, gates: str, seed: int):
    """q, k, v, g, beta, state; g from the tiny layer's default gate at init ("init") or with -1000 resets."""
    config = ModelConfig.from_preset("tiny")
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config)
    gen = torch.Generator().manual_seed(seed)
    dim = config.kda.head_dim_k
    with torch.no_grad():
        g = layer.forget_gate(torch.randn(batch, seq_len, config.hidden_size, generator=gen))[:, :, :heads]
    if gates == "resets":
        g = -5.0 * torch.sigmoid(torch.randn(g.shape, generator=gen))
        g[:, ::7] = SEQUENCE_START_DECAY
    q = torch.randn(batch, seq_len, heads, dim, generator=gen)
    k = l2_norm(torch.randn(batch, seq_len, heads, dim, generator=gen))
    v = torch.randn(batch, seq_len, heads, dim, generator=gen)
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    state = torch.randn(batch, heads, dim, dim, generator=gen)
    return [q, k, v, g, beta, state]


@pytest.mark.parametrize("batch,seq_len,heads", [(1, 37, 1), (2, 21, 2)])
@pytest.mark.parametrize("gates", ["init", "resets"])
def test_chunked_outputs_and_gradients_match_the_recurrence(batch, seq_len, heads, gates):
    inputs = kda_inputs(batch, seq_len, heads, gates, seed=seq_len)
    results = []
    for op, kwargs in ((kda_chunked, dict(chunk_size=16)), (kda_recurrent, {})):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, final = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
        (out.square().sum() + (final * inputs[5]).sum()).backward()
        results.append([out.detach(), final.detach()] + [t.grad for t in leaves])
    for fast, plain in zip(*results):
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch,seq_len,kernel", [(1, 1, 4), (2, 2, 4), (2, 5, 4), (3, 9, 2)])
@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shifted_conv_matches_conv1d(batch, seq_len, kernel, with_tail, dtype):
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randn(batch, seq_len, 6, generator=gen, dtype=dtype)
    tail = torch.randn(batch, kernel - 1, 6, generator=gen, dtype=dtype) if with_tail else None
    weight = torch.randn(6, kernel, generator=gen, dtype=dtype)
    grad_out = torch.randn(batch, seq_len, 6, generator=gen, dtype=dtype)
    results = []
    for conv in (causal_depthwise_conv, causal_depthwise_conv_plain):
        leaves = [t.clone().requires_grad_() for t in (x, tail, weight) if t is not None]
        out = conv(leaves[0], leaves[1] if with_tail else None, leaves[-1])
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for fast, plain in zip(*results):
        torch.testing.assert_close(fast, plain)
    if dtype == torch.float64:
        leaves = [t.clone().requires_grad_() for t in (x, tail, weight) if t is not None]
        assert torch.autograd.gradcheck(lambda *t: causal_depthwise_conv(t[0], t[1] if with_tail else None, t[-1]),
                                        leaves)


def test_shifted_conv_in_bfloat16_sums_in_fp32():
    gen = torch.Generator().manual_seed(1)
    x, tail = torch.randn(2, 8, 8, generator=gen).bfloat16(), torch.randn(2, 3, 8, generator=gen).bfloat16()
    weight = torch.randn(8, 4, generator=gen).bfloat16()
    out = causal_depthwise_conv(x, tail, weight)
    assert out.dtype == torch.bfloat16
    exact = causal_depthwise_conv_plain(x.double(), tail.double(), weight.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=1e-2)


def test_layer_short_conv_forms_agree_with_a_cache():
    """Whole layer with a cache, "shifted" vs "conv1d": outputs, conv tails, weight gradients."""
    config = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config)
    x = torch.randn(2, 15, config.hidden_size)
    results = []
    for form in ("shifted", "conv1d"):
        layer.short_conv_form = form
        layer.zero_grad()
        cache = KDALayerCache()
        # 13 tokens, then 1 (shorter than the conv's history), then 1 more
        out = torch.cat([layer(x[:, :13], cache), layer(x[:, 13:14], cache), layer(x[:, 14:], cache)], dim=1)
        out.square().sum().backward()
        grads = [layer.conv.weight.grad.clone(), layer.q_proj.weight.grad.clone()]
        results.append([out.detach(), cache.conv_state, *grads])
    for fast, plain in zip(*results):
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_layer_rejects_an_unknown_short_conv_form():
    layer = KimiDeltaAttention(ModelConfig.from_preset("tiny"))
    layer.short_conv_form = "fft"
    with pytest.raises(ValueError, match="short_conv_form"):
        layer(torch.randn(1, 3, layer.q_proj.in_features))
