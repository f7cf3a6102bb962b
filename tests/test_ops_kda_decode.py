"""The fused in-place KDA decode step against its twin kda_recurrent (T = 1), and in the paged layer."""
import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.kda_paged import slot_runs
from latentmoe_lab.ops.kda import kda_recurrent
from latentmoe_lab.ops.kda_decode import kda_decode_step_
from latentmoe_lab.ops.norms import l2_norm
from latentmoe_lab.paged_pools import KDAPool


def decode_inputs(seqs, heads, dim_k, dim_v, dtype=torch.float32, seed=0, hard_decay=True):
    """One token per sequence as the layer gives it: realistic gates g = -5 sigmoid(x), some channels fully
    reset (g = -1000) and some strongly decayed, beta in (0, 1), L2-normalised k, a state of unit scale."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seqs, heads, dim_k, generator=gen, dtype=dtype)
    k = l2_norm(torch.randn(seqs, heads, dim_k, generator=gen, dtype=dtype))
    v = torch.randn(seqs, heads, dim_v, generator=gen, dtype=dtype)
    g = -5 * torch.sigmoid(2 * torch.randn(seqs, heads, dim_k, generator=gen, dtype=dtype))
    if hard_decay:
        g[:, 0, : dim_k // 3] = -1000.0
        g[-1, -1, dim_k // 3:] = -30.0
    beta = torch.rand(seqs, heads, generator=gen, dtype=dtype).clamp(1e-3, 1 - 1e-3)
    state = torch.randn(seqs, heads, dim_k, dim_v, generator=gen, dtype=dtype)
    return q, k, v, g, beta, state


def recurrence_by_hand(q, k, v, g, beta, state, scale):
    """The delta rule literally, in the inputs' dtype (kda_recurrent always runs fp32; this checks fp64)."""
    state = g.exp()[..., None] * state
    write = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k[..., None] * write[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * scale, state), state


@pytest.mark.parametrize("seqs,heads,dim_k,dim_v", [(1, 1, 8, 8), (3, 3, 20, 12), (32, 4, 128, 128),
                                                    (5, 2, 33, 64)])
@torch.no_grad()
def test_fused_step_matches_recurrent_fp32(seqs, heads, dim_k, dim_v):
    q, k, v, g, beta, state = decode_inputs(seqs, heads, dim_k, dim_v)
    expected_o, expected_state = kda_recurrent(*(t[:, None] for t in (q, k, v, g, beta)),
                                               initial_state=state, output_final_state=True, backend="torch")
    advanced = state.clone()
    o = kda_decode_step_(advanced, q, k, v, g, beta)
    assert o.shape == (seqs, heads, dim_v) and o.dtype == torch.float32
    torch.testing.assert_close(o, expected_o[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(advanced, expected_state, rtol=1e-5, atol=1e-5)
    # The reset channels of head 0 forgot the old state: the same step from a state zeroed there agrees.
    forgot = state.clone()
    forgot[:, 0, : dim_k // 3] = 0.0
    o_forgot = kda_decode_step_(forgot, q, k, v, g, beta)
    torch.testing.assert_close(o_forgot, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forgot, advanced, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqs,heads,dim_k,dim_v", [(1, 2, 16, 8), (3, 3, 20, 12), (32, 1, 24, 40)])
@torch.no_grad()
def test_fused_step_matches_the_recurrence_in_fp64(seqs, heads, dim_k, dim_v):
    q, k, v, g, beta, state = decode_inputs(seqs, heads, dim_k, dim_v, dtype=torch.float64, seed=1)
    scale = 0.3
    expected_o, expected_state = recurrence_by_hand(q, k, v, g, beta, state, scale)
    o = kda_decode_step_(state, q, k, v, g, beta, scale=scale)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, expected_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_low_precision_inputs_run_in_the_state_dtype():
    q, k, v, g, beta, state = decode_inputs(4, 2, 16, 16, hard_decay=False)
    half = [t.bfloat16() for t in (q, k, v)]
    expected_o, expected_state = kda_recurrent(*(t[:, None] for t in (*half, g, beta)), initial_state=state,
                                               output_final_state=True, backend="torch")
    o = kda_decode_step_(state, *half, g, beta)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), expected_o[:, 0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_only_the_state_is_written():
    q, k, v, g, beta, state = decode_inputs(3, 2, 12, 10)
    inputs = (q, k, v, g, beta)
    before = [t.clone() for t in inputs]
    old_state = state.clone()
    storage = state.data_ptr()
    o = kda_decode_step_(state, *inputs)
    for name, tensor, original in zip("q k v g beta".split(), inputs, before):
        assert torch.equal(tensor, original), f"{name} was modified"
    assert state.data_ptr() == storage and not torch.equal(state, old_state)  # advanced in its own storage
    assert o.data_ptr() not in {t.data_ptr() for t in (state, *inputs)}


def test_bad_inputs_name_the_argument():
    q, k, v, g, beta, state = decode_inputs(3, 2, 12, 10)
    with pytest.raises(ValueError, match="state: expected a contiguous"):
        kda_decode_step_(state.transpose(-1, -2).contiguous().transpose(-1, -2), q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"v: expected shape \[B, H, V\]"):
        kda_decode_step_(state, q, k, v[..., :-1], g, beta)
    with pytest.raises(ValueError, match=r"beta: expected shape \[B, H\]"):
        kda_decode_step_(state, q, k, v, g, beta[:, :1])
    with pytest.raises(ValueError, match=r"g: expected shape \[B, H, K\]"):
        kda_decode_step_(state, q, k, v, g[:2], beta)
    with pytest.raises(ValueError, match="state: expected 4 dims"):
        kda_decode_step_(state[0], q, k, v, g, beta)
    with pytest.raises(ValueError, match="state: expected float32 or float64"):
        kda_decode_step_(state.half(), q, k, v, g, beta)
    with pytest.raises(ValueError, match="state: fp64 inputs need an fp64 state"):
        kda_decode_step_(state, q.double(), k, v, g, beta)
    with pytest.raises(TypeError, match="beta: expected a floating-point dtype"):
        kda_decode_step_(state, q, k, v, g, (beta > 0.5).long())
    with pytest.raises(ValueError, match="scale: expected a finite positive"):
        kda_decode_step_(state, q, k, v, g, beta, scale=float("nan"))
    with pytest.raises(ValueError, match="call it under torch.no_grad"):
        kda_decode_step_(state, q.requires_grad_(), k, v, g, beta)


@torch.no_grad()
@pytest.mark.parametrize("context_lens,lengths,slots", [
    ([5, 7, 9], [1, 1, 1], [3, 0, 2]),  # all decodes, slots out of order
    ([5, 0, 9, 4], [1, 6, 1, 1], [3, 0, 2, 1]),  # decodes not one slice of the batch
    ([0, 3, 0], [1, 1, 5], [3, 0, 2]),  # a fresh one-token prompt
    ([3, 2, 5, 0, 4, 6], [1, 1, 1, 3, 1, 1], [4, 5, 0, 1, 2, 7]),  # decode slot runs {0}, {2}, {4, 5}, {7}
])
def test_paged_layer_fused_equals_recurrent(context_lens, lengths, slots):
    """The layer's paged step with paged_decode "fused" (states advanced in place in the pool, by runs of
    consecutive slots) and "recurrent" (the reference, on a gathered copy): same outputs, same pool rows,
    and the slots outside the batch untouched."""
    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config).eval()
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(8, layer.num_heads, layer.head_dim_k, layer.head_dim_v, generator=gen)
    conv = torch.randn(8, layer.conv_channels, layer.conv_kernel - 1, generator=gen)
    tokens = [[0] * n for n in lengths]
    batch = ForwardBatch.from_sequences(tokens, context_lens, [[i] for i in range(len(lengths))], slots, 64)
    x = torch.randn(1, sum(lengths), config.hidden_size, generator=gen)
    results = {}
    for mode in KimiDeltaAttention.PAGED_DECODES:
        layer.paged_decode = mode
        pool = KDAPool(state=state.clone(), conv=conv.clone())
        results[mode] = (layer(x, batch=batch, pool=pool), pool.state, pool.conv)
    (fused_out, fused_state, fused_conv), (ref_out, ref_state, ref_conv) = results["fused"], results["recurrent"]
    torch.testing.assert_close(fused_out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_state, ref_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_conv, ref_conv)
    assert not torch.equal(fused_state[slots], state[slots])  # every slot in the batch advanced
    others = [s for s in range(8) if s not in slots]
    assert torch.equal(fused_state[others], state[others]) and torch.equal(fused_conv[others], conv[others])


def test_slot_runs_group_members_by_consecutive_slots():
    assert slot_runs([5, 0, 1, 7], ["a", "b", "c", "d"]) == [(0, ["b", "c"]), (5, ["a"]), (7, ["d"])]
    assert slot_runs([2, 3, 4], [0, 1, 2]) == [(2, [0, 1, 2])]
    assert slot_runs([], []) == []


@torch.no_grad()
def test_a_bad_paged_decode_mode_is_refused():
    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config).eval()
    state = torch.zeros(1, layer.num_heads, layer.head_dim_k, layer.head_dim_v)
    conv = torch.zeros(1, layer.conv_channels, layer.conv_kernel - 1)
    batch = ForwardBatch.from_sequences([[0]], [0], [[0]], [0], 64)
    x = torch.randn(1, 1, config.hidden_size)
    layer.paged_decode = "bogus"
    with pytest.raises(ValueError, match="paged_decode: expected one of"):
        layer(x, batch=batch, pool=KDAPool(state=state, conv=conv))
    layer.paged_decode = "fused"
    shared = ForwardBatch.from_sequences([[0], [0]], [3, 4], [[0], [1]], [0, 0], 64)
    with pytest.raises(ValueError, match="batch.state_slot: two sequences share a KDA slot"):
        layer(torch.randn(1, 2, config.hidden_size), batch=shared, pool=KDAPool(state=state, conv=conv))


@torch.no_grad()
def test_a_pool_state_that_is_not_contiguous_takes_the_gathered_path():
    """Rows of a non-contiguous pool state are not contiguous views: the layer gathers instead, same result."""
    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config).eval()
    gen = torch.Generator().manual_seed(4)
    shape = (4, layer.num_heads, layer.head_dim_v, layer.head_dim_k)
    state = torch.randn(*shape, generator=gen).transpose(-1, -2)  # [slots, H, d_k, d_v], not contiguous
    conv = torch.randn(4, layer.conv_channels, layer.conv_kernel - 1, generator=gen)
    batch = ForwardBatch.from_sequences([[0], [0], [0]], [2, 5, 3], [[0], [1], [2]], [2, 0, 1], 64)
    x = torch.randn(1, 3, config.hidden_size, generator=gen)
    results = []
    for mode in KimiDeltaAttention.PAGED_DECODES:
        layer.paged_decode = mode
        pool = KDAPool(state=state.clone(memory_format=torch.preserve_format), conv=conv.clone())
        assert not pool.state.is_contiguous()
        results.append((layer(x, batch=batch, pool=pool), pool.state))
    for fused, reference in zip(*results):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_paged_layer_in_fp64_keeps_the_fp32_pool_state():
    """An fp64 layer on the fp32 pool state: the fused step is skipped (its math would narrow), same as before."""
    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config).double().eval()
    gen = torch.Generator().manual_seed(3)
    state = torch.randn(2, layer.num_heads, layer.head_dim_k, layer.head_dim_v, generator=gen)
    conv = torch.randn(2, layer.conv_channels, layer.conv_kernel - 1, generator=gen, dtype=torch.float64)
    batch = ForwardBatch.from_sequences([[0], [0]], [4, 9], [[0], [1]], [1, 0], 64)
    x = torch.randn(1, 2, config.hidden_size, generator=gen, dtype=torch.float64)
    results = []
    for mode in KimiDeltaAttention.PAGED_DECODES:
        layer.paged_decode = mode
        pool = KDAPool(state=state.clone(), conv=conv.clone())
        results.append((layer(x, batch=batch, pool=pool), pool.state))
    assert results[0][1].dtype == torch.float32 and not torch.equal(results[0][1], state)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("decode", [None, [False, False, False]])
def test_paged_layer_gradients_equal_the_contiguous_layer(decode):
    """With gradients the paged layer takes the gathered path (the one-token prompt through kda_recurrent as a
    decode, or, marked batch.decode False as the serving runner marks prompts, through the chunked form; the
    chunked form past one chunk: lengths 1, 20, 37 at chunk 16); x and every parameter get the gradients of the
    contiguous layer run on each sequence alone. Gates are the layer's own (its default forget gate)."""
    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config)
    gen = torch.Generator().manual_seed(6)
    lengths = [1, 20, 37]
    x = torch.randn(1, sum(lengths), config.hidden_size, generator=gen, requires_grad=True)
    upstream = torch.randn(1, sum(lengths), config.hidden_size, generator=gen)
    params = [p for p in layer.parameters() if p.requires_grad]

    batch = ForwardBatch.from_sequences([[0] * n for n in lengths], [0] * 3, [[i] for i in range(3)], [2, 0, 1], 64)
    batch.decode = None if decode is None else torch.tensor(decode)
    pool = KDAPool(state=torch.zeros(3, layer.num_heads, layer.head_dim_k, layer.head_dim_v),
                   conv=torch.zeros(3, layer.conv_channels, layer.conv_kernel - 1))
    paged = layer(x, batch=batch, pool=pool)
    paged_grads = torch.autograd.grad(paged, [x, *params], upstream)

    starts = [0, 1, 21, 58]
    alone = torch.cat([layer(x[:, a:b]) for a, b in zip(starts, starts[1:])], dim=1)
    alone_grads = torch.autograd.grad(alone, [x, *params], upstream)
    torch.testing.assert_close(paged, alone, rtol=1e-5, atol=1e-5)
    for got, expected in zip(paged_grads, alone_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert paged_grads[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in paged_grads[1:4])
