"""torch.compile paths against their eager twins: chunked KDA (values and gradients) and the decode step.

Compiled with backend="aot_eager" (graph capture + AOT autograd, no code generation) to keep the test
in seconds on a CPU: it checks that the graphs trace and replay the eager math. Inductor itself is
measured in benchmarks/bench_decode.py.
"""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.compiled import compile_decode, eager_decode
from latentmoe_lab.ops.kda import kda_chunked
from latentmoe_lab.ops.kda_compiled import kda_chunked_compiled
from latentmoe_lab.ops.norms import l2_norm


def _inputs(seq_len, heads=2, dim=8, requires_grad=False):
    gen = torch.Generator().manual_seed(seq_len)
    q = torch.randn(1, seq_len, heads, dim, generator=gen)
    k = l2_norm(torch.randn(1, seq_len, heads, dim, generator=gen))
    v = torch.randn(1, seq_len, heads, dim, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(1, seq_len, heads, dim, generator=gen))  # realistic, hard decays
    beta = torch.rand(1, seq_len, heads, generator=gen)
    state = torch.randn(1, heads, dim, dim, generator=gen)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("seq_len", [1, 40])  # one token; several chunks with a ragged tail (40 = 2 x 16 + 8)
def test_compiled_kda_equals_eager(seq_len):
    q, k, v, g, beta, state = _inputs(seq_len)
    want = kda_chunked(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=16,
                       backend="torch")
    got = kda_chunked_compiled(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=16,
                               compile_backend="aot_eager")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_kda_gradients_equal_eager():
    inputs = _inputs(21, requires_grad=True)
    grads = []
    for run in (lambda *t: kda_chunked(*t[:5], initial_state=t[5], output_final_state=True, chunk_size=16,
                                       backend="torch"),
                lambda *t: kda_chunked_compiled(*t[:5], initial_state=t[5], output_final_state=True, chunk_size=16,
                                                compile_backend="aot_eager")):
        out, state = run(*inputs)
        grads.append(torch.autograd.grad(out.square().sum() + state.sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_kda_rejects_unknown_backend():
    with pytest.raises(ValueError, match="compile_backend"):
        kda_chunked_compiled(*_inputs(4)[:5], compile_backend="tvm")


def test_compiled_decode_equals_eager():
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))

    def decode_logits():
        cache = model.new_cache()
        with torch.no_grad():
            logits = [model(ids, cache=cache).logits[:, -1]]
            for _ in range(3):
                logits.append(model(logits[-1].argmax(-1, keepdim=True), cache=cache).logits[:, -1])
        return torch.stack(logits)

    want = decode_logits()
    compile_decode(model, backend="aot_eager")
    try:
        got = decode_logits()
    finally:
        eager_decode(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all("forward" not in block.ffn.__dict__ for block in model.layers)
    with pytest.raises(ValueError, match="backend"):
        compile_decode(model, backend="tvm")
