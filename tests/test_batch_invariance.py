"""Batch invariance (serving/invariance.py): a request's logits, bit for bit, whatever shares its steps.

Each layer of the mechanism on its own (the row-invariant activations, the padded GEMMs, the grouped expert
product, the scheduler's chunk grid, the rules), then the engine end to end: prefix caching on against off,
one request alone against a busy mixed batch at another budget.
"""
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab.ops import activations, batch_invariant
from latentmoe_lab.ops.batch_invariant import check_row_invariance, batch_invariant_mode
from latentmoe_lab.ops.routing import grouped_matmul, grouped_matmul_reference
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.invariance import recorded_logits

ACTIVATIONS = {"sigmoid": (activations.sigmoid, torch.sigmoid), "silu": (activations.silu, F.silu),
               "softplus": (activations.softplus, lambda x: torch.logaddexp(x, torch.zeros_like(x)))}
# (softplus: F.softplus returns x itself past x = 20, an error of exp(-x) that fp64 sees)
TORCH_KERNELS = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_bits_do_not_depend_on_the_position_in_the_tensor(name):
    ours, _ = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 3, generator=g) * 4  # width 3: most slices end in a vector tail
    assert torch.equal(ours(x), TORCH_KERNELS[name](x))  # outside the mode: torch's own kernel
    with batch_invariant_mode():
        whole = ours(x)
        for start, stop in ((0, 1), (1, 2), (7, 12), (100, 133), (2500, 4999), (3, 5000)):
            assert torch.equal(ours(x[start:stop].clone()), whole[start:stop]), (start, stop)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_activation_values_and_gradients_match_torch(name, dtype):
    ours, theirs = ACTIVATIONS[name]
    x = torch.cat([torch.linspace(-30, 30, 997), torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])]).to(dtype)
    x.requires_grad_(True)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
    with batch_invariant_mode():
        y = ours(x)
    y_ref = theirs(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    grad, = torch.autograd.grad(y.sum(), x)  # the mode's backward (saved in the graph)
    grad_ref, = torch.autograd.grad(y_ref.sum(), x)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, grad_ref, rtol=tol, atol=tol)


def test_activation_gradcheck():
    x = (torch.randn(40, dtype=torch.float64) * 5).requires_grad_(True)
    with batch_invariant_mode():
        for ours, _ in ACTIVATIONS.values():
            assert torch.autograd.gradcheck(ours, (x,))


def test_this_machine_meets_the_gemm_premise():
    check_row_invariance(torch.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 11, 15, 16, 17, 40])
@pytest.mark.parametrize("cols", [1, 2, 7, 15, 33])
def test_padded_products_equal_the_rows_of_a_large_product(rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    a, b = torch.randn(64, 48, generator=g), torch.randn(48, 64, generator=g)
    bias, c = torch.randn(64, generator=g), torch.randn(3, 64, 64, generator=g)
    a3, b3 = torch.randn(3, 64, 48, generator=g), torch.randn(3, 48, 64, generator=g)
    big = {"mm": a @ b, "addmm": torch.addmm(bias, a, b, beta=0.5, alpha=2.0), "bmm": torch.bmm(a3, b3),
           "baddbmm": torch.baddbmm(c, a3, b3, beta=0.5, alpha=2.0)}  # 64 x 64: torch's kernels, no padding
    with batch_invariant_mode():
        assert batch_invariant.active()
        small = {"mm": a[:rows] @ b[:, :cols],
                 "addmm": torch.addmm(bias[:cols], a[:rows], b[:, :cols], beta=0.5, alpha=2.0),
                 "linear": F.linear(a[:rows], b[:, :cols].t(), bias[:cols]),
                 "bmm": torch.bmm(a3[:, :rows], b3[..., :cols]),
                 "baddbmm": torch.baddbmm(c[:, :rows, :cols], a3[:, :rows], b3[..., :cols], beta=0.5, alpha=2.0)}
    assert not batch_invariant.active()
    linear_big = F.linear(a, b.t(), bias)
    assert torch.equal(small["mm"], big["mm"][:rows, :cols])
    assert torch.equal(small["bmm"], big["bmm"][:, :rows, :cols])
    for name in ("addmm", "baddbmm"):  # beta * c + alpha * ab rounds the same way in both
        expected = big[name][..., :rows, :cols]
        assert small[name].shape == expected.shape
        torch.testing.assert_close(small[name], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(small["linear"], linear_big[:rows, :cols], rtol=0, atol=1e-5)


def test_padded_products_broadcast_a_scalar_bias():
    a, b = torch.randn(3, 8), torch.randn(8, 5)
    with batch_invariant_mode():
        got = torch.addmm(torch.tensor(0.5), a, b)
    torch.testing.assert_close(got, 0.5 + a @ b)


def test_the_override_ends_with_the_context():
    a, b = torch.randn(1, 32), torch.randn(32, 32)
    before = a @ b
    with batch_invariant_mode():
        inside = a @ b
        with batch_invariant_mode():  # re-entered: still on, and still on after the inner exit
            pass
        assert torch.equal(a @ b, inside)
    assert torch.equal(a @ b, before)
    torch.testing.assert_close(inside, before)


def test_grouped_rows_do_not_depend_on_their_group_size():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 32, 48, generator=g)
    x = torch.randn(40, 32, generator=g)
    with batch_invariant_mode():
        crowded = grouped_matmul(x, w, torch.tensor([10, 20, 30, 40]))  # 10 rows per expert
        for counts in ([1, 0, 0, 0], [0, 3, 0, 0], [2, 0, 5, 1]):
            offsets = torch.tensor(counts).cumsum(0)
            rows = torch.cat([torch.arange(10 * e, 10 * e + n) for e, n in enumerate(counts)])
            sparse = grouped_matmul(x[rows], w, offsets)
            assert torch.equal(sparse, crowded[rows]), counts
            torch.testing.assert_close(sparse, grouped_matmul_reference(x[rows], w, offsets))


def invariant_service(chunk=512, prefix=False, block=64, max_num_seqs=8, **scheduler):
    return ServiceConfig.from_dict({
        "model": {"max_model_len": 1024},
        "memory": {"cache_bytes": 64 << 20, "block_size": block, "max_num_seqs": max_num_seqs,
                   "prefix_cache": {"enabled": prefix}},
        "scheduler": {"prefill_chunk_size": chunk, "batch_invariant": True, **scheduler}})


def test_chunks_end_on_the_grid_except_at_a_prompts_end(model):
    grid = model.chunk_grid()
    assert grid == 64  # the tiny preset's KDA chunk and DSA query block
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 300, 129, 64, 500, 5)]
    engine = Engine(model, invariant_service(chunk=200))
    ends = []
    run = engine.runner.run

    def record(batch):
        ends.extend((seq.num_computed + n, seq.num_tokens) for seq, n in batch.entries if n > 1)
        return run(batch)

    engine.runner.run = record
    engine.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert ends and all(end % grid == 0 or end == total for end, total in ends)
    assert any(end % grid == 0 and end < total for end, total in ends)  # the budget did cut prompts


@pytest.mark.parametrize("change, message", [
    ({"scheduler": {"prefill_chunk_size": 100}}, "scheduler.prefill_chunk_size: (100) must be >= 128"),
    ({"memory": {"prefix_cache": {}, "block_size": 16}}, "memory.block_size: (16) must be a multiple"),
    ({"parallel": {"forward_process": True}}, "scheduler.batch_invariant: needs the forward in the engine's process"),
])
def test_rules(model, change, message):
    d = invariant_service().to_dict()
    for section, values in change.items():
        d[section].update(values)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Engine(model, ServiceConfig.from_dict(d))


def test_config_type():
    with pytest.raises(ValueError, match="scheduler.batch_invariant: expected bool"):
        ServiceConfig.from_dict({"memory": {"cache_bytes": 1 << 20}, "scheduler": {"batch_invariant": "yes"}})


def sampled_logits(engine, prompts, params, split=None):
    """Serve prompts (the first `split` alone first, then the rest) -> ({(prompt index, position): the logits
    row a token was sampled from}, the outputs' token ids)."""
    outputs = []
    with recorded_logits(engine) as rows:
        for part in ([prompts[:split], prompts[split:]] if split else [prompts]):
            outputs += engine.generate(part, params, use_tqdm=False)
    index_of = {o.request_id: i for i, o in enumerate(outputs)}
    return {(index_of[rid], pos): row for (rid, pos), row in rows.items()}, [o.token_ids for o in outputs]


def test_recorded_logits_are_the_rows_sampled_from(model):
    engine = Engine(model, invariant_service())
    prompt = torch.randint(0, 256, (70,)).tolist()
    with recorded_logits(engine) as rows:
        output = engine.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert sorted(pos for _, pos in rows) == [69, 70, 71, 72]
    assert [int(rows[(output.request_id, pos)].argmax()) for pos in (69, 70, 71, 72)] == output.token_ids
    assert "run" not in vars(engine.runner)  # the runner is itself again


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (256,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (16, 5, 40, 1, 70, 16, 9, 33)]


def test_prefix_hits_change_no_bit(model, shared_prefix_prompts):
    params = SamplingParams(max_tokens=6)
    off, out_off = sampled_logits(Engine(model, invariant_service(prefix=False)), shared_prefix_prompts,
                                      params, split=1)
    engine = Engine(model, invariant_service(prefix=True))
    on, out_on = sampled_logits(engine, shared_prefix_prompts, params, split=1)
    assert engine.stats()["prefix_hit_tokens"] >= 7 * 256
    assert on.keys() == off.keys() and len(on) == 8 * 6
    assert all(torch.equal(on[key], off[key]) for key in on)
    assert out_on == out_off


def test_a_request_alone_equals_it_in_a_busy_step_at_another_budget(model, shared_prefix_prompts):
    g = torch.Generator().manual_seed(4)
    others = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 2, 130, 77, 190, 64, 12)]
    target = shared_prefix_prompts[2]
    params = SamplingParams(max_tokens=8)
    alone, out_alone = sampled_logits(Engine(model, invariant_service(chunk=512)), [target], params)
    # the target arrives last, behind 7 others, at a budget of 128: its chunks share steps with decodes
    busy, out_busy = sampled_logits(Engine(model, invariant_service(chunk=128)), others + [target], params)
    target_rows = {pos: row for (i, pos), row in busy.items() if i == len(others)}
    assert target_rows.keys() == {pos for _, pos in alone} and len(target_rows) == 8
    assert all(torch.equal(target_rows[pos], alone[(0, pos)]) for pos in target_rows)
    assert out_busy[-1] == out_alone[0]
