"""kda_chunked's gradients, all six inputs, against autograd through the per-token recurrence.

Metric: per input tensor, ||grad - reference||_2 <= 1e-5 ||reference||_2 + 1e-7 sqrt(numel), and every entry
finite. The absolute term (an RMS error of 1e-7, far below fp32 rounding of these O(1) gradients) is for
references that are exactly zero: g's when T = 1 and no state (the chunked form's i- and j-side terms cancel
to ~1e-9, the recurrence never forms them) and the initial state's after a reset at t = 0. Gates are the
realistic ones (K3's lower-bound form g = -5 sigmoid(x) decays ~e^-160 over a 64-token chunk, past the
1e-20 growth limit of ops/kda_intra.py, which is where autograd through the product form went NaN).
"""
import pytest
import torch
import torch.nn.functional as F

import latentmoe_lab.ops.kda_intra as kda_intra
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.kda_intra import DecayProduct, GrownKeys
from latentmoe_lab.ops.norms import l2_norm

GATES = ["lower_bound_x_std_1", "lower_bound_x_std_5", "softplus", "resets"]
LENGTHS = [1, 63, 64, 65, 200, 1000]


def make_gates(kind: str, shape, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """[B, T, H, K] log decays: lower-bound -5 sigmoid(x) with x ~ N(0, 1) or N(0, 25); the layer's softplus
    form -exp(A) softplus(x), exp(A) in [1, 16] per head (down to g ~ -150: exp(g) is 0 or denormal in fp32);
    or lower-bound gates with g = -1000 resets (as layers/kda.py writes at sequence starts) at t = 5, 42, 79, ...
    and 63 (a chunk's last token), or at t = 0 when T = 1."""
    x = torch.randn(shape, generator=gen, dtype=dtype)
    if kind == "lower_bound_x_std_1":
        return -5.0 * torch.sigmoid(x)
    if kind == "lower_bound_x_std_5":
        return -5.0 * torch.sigmoid(5.0 * x)
    if kind == "softplus":
        rate = 1.0 + 15.0 * torch.rand(shape[2], 1, generator=gen, dtype=dtype)
        return -rate * F.softplus(3.0 * x)
    g = -5.0 * torch.sigmoid(x)
    g[:, min(shape[1] - 1, 5)::37] = -1000.0
    g[:, 63:64] = -1000.0
    return g


def make_case(gates: str, seq_len: int, with_state: bool, seed: int = 0, dtype=torch.float32,
              batch: int = 1, heads: int = 2, dim_k: int = 16, dim_v: int = 16):
    """Inputs (q, k, v, g, beta, initial_state or None) and the weights of a loss on o and on the final state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim_k, generator=gen, dtype=dtype)
    k = l2_norm(torch.randn(batch, seq_len, heads, dim_k, generator=gen, dtype=dtype))
    v = torch.randn(batch, seq_len, heads, dim_v, generator=gen, dtype=dtype)
    g = make_gates(gates, (batch, seq_len, heads, dim_k), gen, dtype)
    beta = torch.rand(batch, seq_len, heads, generator=gen, dtype=dtype)
    state = torch.randn(batch, heads, dim_k, dim_v, generator=gen, dtype=dtype) if with_state else None
    out_weight = torch.randn(batch, seq_len, heads, dim_v, generator=gen, dtype=dtype)
    state_weight = torch.randn(batch, heads, dim_k, dim_v, generator=gen, dtype=dtype)
    return [q, k, v, g, beta, state], out_weight, state_weight


def gradients(op, inputs, out_weight, state_weight, **kwargs):
    """Gradients of sum(w_o * o) + sum(w_s * final state) with respect to each input (None stays None)."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    out, final = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
    ((out * out_weight).sum() + (final * state_weight).sum()).backward()
    return [None if t is None else t.grad for t in leaves]


def assert_gradients_match(mine, reference, rtol=1e-5):
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), mine, reference):
        if want is None:
            continue
        assert torch.isfinite(got).all(), f"{name}: non-finite gradient"
        error, size = (got - want).norm().item(), want.norm().item()
        assert error <= rtol * size + 1e-7 * want.numel() ** 0.5, \
            f"{name}: ||grad - reference|| = {error:.3e}, ||reference|| = {size:.3e}"


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
@pytest.mark.parametrize("seq_len", LENGTHS)
@pytest.mark.parametrize("gates", GATES)
def test_gradients_match_autograd_through_the_recurrence(gates, seq_len, with_state):
    inputs, out_weight, state_weight = make_case(gates, seq_len, with_state)
    mine = gradients(kda_chunked, inputs, out_weight, state_weight, chunk_size=64)
    reference = gradients(kda_recurrent, inputs, out_weight, state_weight)
    assert_gradients_match(mine, reference)


def test_gradient_without_a_final_state_ragged_chunks_and_groups(monkeypatch):
    """No output_final_state, chunk 48 (not dividing T), B = 2, one chunk per group: the loss sees o only."""
    monkeypatch.setattr("latentmoe_lab.ops.kda.GROUP_ROWS", 100)
    inputs, out_weight, _ = make_case("lower_bound_x_std_1", 130, True, seed=3, batch=2)
    grads = []
    for op, kwargs in ((kda_chunked, dict(chunk_size=48)), (kda_recurrent, {})):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, final = op(*leaves[:5], initial_state=leaves[5], **kwargs)
        assert final is None
        (out * out_weight).sum().backward()
        grads.append([t.grad for t in leaves])
    assert_gradients_match(*grads)


@pytest.mark.parametrize("safe_growth,pairwise_size,gates", [
    (1e20, 8, "lower_bound_x_std_5"),  # the default limits
    (1.0, 2, "resets"),  # every decaying block halved, down to pairs
    (1e3, 2, "softplus"),  # some blocks grown, some halved
], ids=["default", "all-halved", "mixed"])
def test_gradcheck_in_fp64(monkeypatch, safe_growth, pairwise_size, gates):
    monkeypatch.setattr(kda_intra, "SAFE_GROWTH", safe_growth)
    monkeypatch.setattr(kda_intra, "PAIRWISE_SIZE", pairwise_size)
    inputs, _, _ = make_case(gates, 10, True, seed=1, dtype=torch.float64, heads=1, dim_k=2, dim_v=2)
    leaves = [t.requires_grad_() for t in inputs]

    def op(*args):
        return kda_chunked(*args[:5], initial_state=args[5], output_final_state=True, chunk_size=8)

    assert torch.autograd.gradcheck(op, leaves)


@pytest.mark.parametrize("kind", ["prefix", "suffix", "pairwise"])
def test_decay_products_match_autograd_through_plain_products(kind):
    """The log-space backward equals autograd through exp().cumprod() where the latter is safe (mild g)."""
    gen = torch.Generator().manual_seed(2)
    g = (-0.5 * torch.rand(3, 6, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    weight = torch.randn((3, 6, 6, 4) if kind == "pairwise" else (3, 6, 4), generator=gen, dtype=torch.float64)
    (DecayProduct.apply(g, g.detach().exp(), kind) * weight).sum().backward()
    mine, g.grad = g.grad, None
    steps = g.exp()
    if kind == "prefix":
        plain = steps.cumprod(dim=-2)
    elif kind == "suffix":
        plain = torch.cat([torch.ones_like(steps[:, :1]), steps.flip(-2)[:, :-1]], dim=-2).cumprod(dim=-2).flip(-2)
    else:
        later = torch.ones(6, 6).tril(-1).bool()[..., None]
        plain = torch.where(later, steps[:, :, None, :], 1.0).cumprod(dim=1)
    torch.testing.assert_close(DecayProduct.apply(g, steps.detach(), kind), plain, rtol=1e-12, atol=0)
    (plain * weight).sum().backward()
    torch.testing.assert_close(mine, g.grad, rtol=1e-12, atol=1e-14)


def test_grown_keys_match_autograd_through_the_division():
    gen = torch.Generator().manual_seed(4)
    g = (-0.5 * torch.rand(3, 6, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    keys = torch.randn(3, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 6, 4, generator=gen, dtype=torch.float64)
    (GrownKeys.apply(g, keys, g.detach().exp().cumprod(dim=-2), 1e-20) * weight).sum().backward()
    mine = g.grad, keys.grad
    g.grad = keys.grad = None
    (keys / g.exp().cumprod(dim=-2) * weight).sum().backward()
    torch.testing.assert_close(mine, (g.grad, keys.grad), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("chunk_size", [None, 64], ids=["tiny-preset-chunk", "kda-default-chunk"])
def test_tiny_model_gets_finite_gradients_on_a_packed_200_token_batch(monkeypatch, chunk_size):
    """One backward of the tiny model on 200 tokens packed as sequences of 70 and 130 (SEQUENCE_START_DECAY
    resets inside a chunk), with the gates moved to K3's working range: rate 1 and no bias, g ~ -5 sigmoid(~0)."""
    config = ModelConfig.from_preset("tiny")
    assert config.kda.gate_form == "lower_bound"
    if chunk_size is not None:
        config = config.replace(kda={**config.to_dict()["kda"], "chunk_size": chunk_size})
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    kda_layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert kda_layers
    with torch.no_grad():
        for layer in kda_layers:
            layer.A_log.zero_()
            layer.dt_bias.zero_()
    gates = []
    forget_gate = KimiDeltaAttention.forget_gate
    monkeypatch.setattr(KimiDeltaAttention, "forget_gate",
                        lambda self, x: gates.append(forget_gate(self, x)) or gates[-1])

    input_ids = torch.randint(0, config.vocab_size, (1, 200))
    logits = model(input_ids, cu_seqlens=torch.tensor([0, 70, 200])).logits
    targets = input_ids[:, 1:].clone()
    targets[:, 69] = -100  # the first sequence's last token does not predict the second's first
    F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100).backward()

    assert len(gates) == len(kda_layers)
    for g in gates:  # a chunk of 16 tokens decays past e^-20, of 64 past the 1e-20 growth limit (46 nats)
        assert g.mean() < -2.0 and g.min() >= -5.0
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients in {bad}"
    for layer in kda_layers:
        assert layer.f_up.weight.grad.abs().sum() > 0 and layer.A_log.grad.abs().sum() > 0
