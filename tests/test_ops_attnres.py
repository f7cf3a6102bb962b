"""ops.attnres: the stacked form, its per-candidate twin, the formula and FLA's naive math agree (fp64),
outputs and every input's gradient, on ragged shapes with 1 to 9 candidates."""
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab.ops.attnres import attn_res, attn_res_reference, attn_res_weights


def fla_naive_math(query, residuals, rms_weight, eps):
    """FLA's naive_attnres (fla/ops/attnres/naive.py) at scale 1 with no output norm, transcribed from its
    description: keys = rms_norm(v) with the weight, logits = keys . q, softmax over the source axis, sum p v.
    FLA computes in fp32; here fp64 inputs stay fp64 so the comparison can be tight."""
    hidden = residuals[0].shape[-1]
    values = torch.stack([r.reshape(-1, hidden) for r in residuals])
    values = values.double() if values.dtype == torch.float64 else values.float()
    keys = F.rms_norm(values, (hidden,), rms_weight.to(values.dtype), eps)
    p = torch.einsum("lnd,d->ln", keys, query.to(values.dtype)).softmax(dim=0)
    return torch.einsum("ln,lnd->nd", p, values).reshape(residuals[0].shape).to(residuals[0].dtype)


def formula(query, residuals, rms_weight, eps):
    """The textbook statement: one token at a time, one candidate at a time, python floats for the softmax."""
    hidden = residuals[0].shape[-1]
    flat = [r.reshape(-1, hidden) for r in residuals]
    rows = []
    for t in range(flat[0].shape[0]):
        logits = []
        for v in flat:
            rms = ((v[t] ** 2).mean() + eps).sqrt()
            logits.append((query * rms_weight * v[t] / rms).sum())
        p = torch.softmax(torch.stack(logits), 0)
        rows.append(sum(p[i] * flat[i][t] for i in range(len(flat))))
    return torch.stack(rows).reshape(residuals[0].shape)


FORMS = {"attn_res": attn_res, "reference": attn_res_reference, "fla_naive": fla_naive_math}


@pytest.mark.parametrize("sources, shape", [(1, (3, 5, 8)), (2, (1, 7, 16)), (4, (2, 3, 24)), (9, (13, 12)),
                                            (6, (5, 1, 40))])
def test_forms_agree_outputs_and_gradients(sources, shape):
    hidden = shape[-1]
    g = torch.Generator().manual_seed(sources)
    # Candidates of very different sizes (the embedding is small, block sums grow), as in a model.
    base = [torch.randn(shape, generator=g, dtype=torch.float64) * (0.05 + i) for i in range(sources)]
    q0 = torch.randn(hidden, generator=g, dtype=torch.float64)
    w0 = 1 + 0.3 * torch.randn(hidden, generator=g, dtype=torch.float64)
    grad_out = torch.randn(shape, generator=g, dtype=torch.float64)
    results = {}
    for name, fn in {**FORMS, "formula": formula}.items():
        residuals = [r.clone().requires_grad_(True) for r in base]
        q, w = q0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = fn(q, residuals, w, 1e-6)
        (out * grad_out).sum().backward()
        results[name] = (out.detach(), q.grad, w.grad, [r.grad for r in residuals])
    want = results["formula"]
    for name, got in results.items():
        torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12, msg=f"{name}: output")
        torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-11, msg=f"{name}: query grad")
        torch.testing.assert_close(got[2], want[2], rtol=1e-9, atol=1e-11, msg=f"{name}: rms_weight grad")
        for i, (a, b) in enumerate(zip(got[3], want[3])):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"{name}: grad of candidate {i}")
    if sources > 1:  # the query must matter, or the gradient checks above would be vacuous
        assert results["formula"][1].abs().max() > 1e-6


def test_weights_sum_to_one_and_zero_query_is_the_mean():
    residuals = [torch.randn(2, 3, 8, dtype=torch.float64) for _ in range(5)]
    p = attn_res_weights(torch.zeros(8, dtype=torch.float64), residuals, torch.ones(8, dtype=torch.float64))
    assert p.shape == (5, 2, 3)
    torch.testing.assert_close(p, torch.full_like(p, 0.2))
    out = attn_res(torch.zeros(8, dtype=torch.float64), residuals, torch.ones(8, dtype=torch.float64))
    torch.testing.assert_close(out, torch.stack(residuals).mean(0))


def test_one_candidate_is_itself_and_dtype_is_kept():
    v = torch.randn(4, 16, dtype=torch.bfloat16)
    out = attn_res(torch.randn(16), [v], torch.ones(16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, v)


@pytest.mark.parametrize("fn", [attn_res, attn_res_reference, attn_res_weights])
def test_bad_inputs_name_the_argument(fn):
    v = torch.randn(2, 8)
    with pytest.raises(ValueError, match="residuals"):
        fn(torch.zeros(8), [], torch.ones(8))
    with pytest.raises(ValueError, match="residuals"):
        fn(torch.zeros(8), [v, torch.randn(3, 8)], torch.ones(8))
    with pytest.raises(ValueError, match="residuals"):
        fn(torch.zeros(8), torch.stack([v, v]), torch.ones(8))
    with pytest.raises(ValueError, match="query"):
        fn(torch.zeros(7), [v], torch.ones(8))
    with pytest.raises(ValueError, match="rms_weight"):
        fn(torch.zeros(8), [v], torch.ones(8, 1))
    with pytest.raises(ValueError, match="eps"):
        fn(torch.zeros(8), [v], torch.ones(8), 0.0)
