"""Prefill/decode disaggregation across tensor-parallel layouts (docs/design.md §13.1): the payload carries
whole heads; a TP prefill gathers its ranks' KDA heads, a TP decode slices them back per rank."""
import pytest
import torch

from disagg_cases import PARAMS, model, prompts, run_1p1d, service  # noqa: F401
from latentmoe_lab.serving import Engine
from latentmoe_lab.serving.transport import decode, export_request, release_exported
from latentmoe_lab.serving.transport.tp_rows import gather_heads, slice_heads

def test_tp2_prefill_to_tp1_decode(model, prompts):
    """A tensor-parallel prefill's KDA heads are gathered from its two ranks; a TP1 decode finishes the requests."""
    chosen = [prompts[i] for i in (0, 11, 14)]
    expected = [o.token_ids for o in Engine(model, service("fp8")).generate(chosen, PARAMS, use_tqdm=False)]
    prefill = Engine(model, service("fp8", tensor_parallel_size=2))
    try:
        outputs, transfers = run_1p1d(prefill, Engine(model, service("fp8")), chosen, check_pools=False)
        assert prefill.block_manager.blocks_used == 0 and prefill.block_manager.slots_used == 0
    finally:
        prefill.close()
    assert [o.token_ids for o in outputs] == expected
    # the gathered state is the one-process state up to the TP reductions' rounding (a misplaced head is O(1))
    one = Engine(model, service("fp8"))
    request = one.add_request(chosen[2], PARAMS)
    while not one.sequence(request).generated_ids:
        one.step()
    alone = export_request(one, request)
    gathered = next(decode(payload) for n, payload in transfers if n == len(chosen[2]))
    torch.testing.assert_close(gathered.kda_state, alone.kda_state, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gathered.kda_conv, alone.kda_conv, atol=1e-5, rtol=1e-4)
    release_exported(one, request)


def test_tp1_prefill_to_tp2_decode(model, prompts):
    """The other way: each decode rank gets its KDA heads (and conv channels) sliced from the payload."""
    chosen = [prompts[i] for i in (3, 9, 15)]
    expected = [o.token_ids for o in Engine(model, service("bf16")).generate(chosen, PARAMS, use_tqdm=False)]
    decode_engine = Engine(model, service("bf16", tensor_parallel_size=2))
    try:
        outputs, _ = run_1p1d(Engine(model, service("bf16")), decode_engine, chosen, check_pools=False)
        assert decode_engine.block_manager.blocks_used == 0 and decode_engine.block_manager.slots_used == 0
    finally:
        decode_engine.close()
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("parts", [2, 4])
def test_heads_slice_and_gather_are_inverse(parts):
    """The whole-model rows -> every tp rank's share -> gathered back: the same tensors; a rank's KDA conv
    share is its heads' q, k and v channels (the layout of parallel/tensor.py shard_kda)."""
    heads, d_k, d_v, generator = 4, 3, 5, torch.Generator().manual_seed(parts)
    rows = {"dsa_latent": torch.randint(0, 255, (2, 7, 9), dtype=torch.uint8, generator=generator),
            "dsa_index": torch.randint(0, 255, (2, 7, 6), dtype=torch.uint8, generator=generator),
            "kda_state": torch.randn(3, heads, d_k, d_v, generator=generator),
            "kda_conv": torch.randn(3, heads * (2 * d_k + d_v), 2, generator=generator)}
    shares = [slice_heads(rows, index, parts, d_k, d_v) for index in range(parts)]
    gathered = gather_heads(shares, d_k, d_v)
    for name, tensor in rows.items():
        assert torch.equal(gathered[name], tensor)
    local = heads // parts
    q, k, v = rows["kda_conv"].split([heads * d_k, heads * d_k, heads * d_v], dim=1)
    last = shares[-1]["kda_conv"]
    assert torch.equal(last[:, :local * d_k], q[:, -local * d_k:])
    assert torch.equal(last[:, local * d_k:2 * local * d_k], k[:, -local * d_k:])
    assert torch.equal(last[:, 2 * local * d_k:], v[:, -local * d_v:])
    with pytest.raises(ValueError, match="parallel.tensor_parallel_size: \\(3\\) must divide the KDA heads"):
        slice_heads(rows, 0, 3, d_k, d_v)
