"""memory.state_dtype (quant/kda_state.py, ops/state_quant.py): KDA states and conv tails stored in fp32, bf16 or
int8 with error feedback. The codec against its plain twin on ragged rows; feedback accumulating what rounding
drops; the paged layer through int8 slots against the codec applied to fp32 slots; planned == allocated; a
request moved through P/D, a spill and a preemption with an int8 state giving the tokens of the same int8
engine without the move; config refusals naming the key, before anything is allocated."""
import dataclasses
import math

import pytest
import torch

from disagg_cases import PARAMS, model, prompts, run_1p1d, service  # noqa: F401
from latentmoe_lab import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.ops.state_quant import (decode_row_plain, decode_rows, encode_row_plain, encode_rows, row_bytes,
                                           row_length)
from latentmoe_lab.paged_pools import KDAPool, PagedPools, paged_pool_bytes
from latentmoe_lab.quant.kda_state import (FEEDBACK_BITS, STATE_DTYPES, Int8ConvFormat, Int8StateFormat,
                                           kda_slot_formats)
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving import config as service_config
from latentmoe_lab.serving.cache_tiers.offload_plan import request_tier_bytes
from latentmoe_lab.serving.planner import allocate_pools, plan_cache, pools_bytes
from latentmoe_lab.serving.service_plan import per_sequence_bytes
from latentmoe_lab.serving.transport import bytes_per_request, decode, encode, import_request, prefill_step
from latentmoe_lab.serving.transport.pool_rows import read_request_rows
from latentmoe_lab.serving.transport.tp_rows import gather_heads, slice_heads
from latentmoe_lab.serving.transport.wire import payload_tensor_bytes

INT8 = {"state_dtype": "int8"}


def invariant_service(state_dtype: str = "int8", speculative: dict | None = None) -> ServiceConfig:
    """disagg_cases' service, batch-invariant (blocks of 64, chunks of 128): a request's logits do not depend on
    the other requests in its steps, which a bf16 or int8 state would otherwise turn into other tokens (a
    one-ulp difference moves a rounding by a code step)."""
    return ServiceConfig.from_dict({
        "model": {"preset": "tiny", "max_model_len": 256},
        "memory": {"max_num_seqs": 4, "block_size": 64, "cache_bytes": 2_000_000, "prefix_cache": {},
                   "state_dtype": state_dtype},
        "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 128, "batch_invariant": True}}
        | ({"speculative": speculative} if speculative else {}))


def ragged_rows(n: int, rows: int, seed: int) -> torch.Tensor:
    """[rows, n]: magnitudes from 1e-6 to 1e3, an all-zero row, a row with one non-zero value."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, n, generator=g) * torch.logspace(-6, 3, rows)[:, None]
    values[1] = 0.0
    values[2] = 0.0
    values[2, -1] = -3.5
    return values


# ------------------------------------------------------------------------------ the codec
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 63, 64])
@pytest.mark.parametrize("bits", [0, 4, 8])
def test_the_codec_equals_its_plain_twin_byte_for_byte(n, bits):
    values = ragged_rows(n, 12, seed=n)
    previous = encode_rows(ragged_rows(n, 12, seed=100 + n) * 0.01, bits) if bits else None
    stored = encode_rows(values, bits, previous)
    assert stored.shape == (12, row_bytes(n, bits)) and row_length(stored.shape[1], bits) == n
    assert row_bytes(n, bits) == n + 4 + {0: 0, 4: (n + 1) // 2, 8: n}[bits]
    for r in range(12):
        prev = None if previous is None else bytes(previous[r].tolist())
        assert bytes(stored[r].tolist()) == encode_row_plain(values[r].tolist(), bits, prev), f"row {r}"
        assert decode_rows(stored[r], bits).tolist() == decode_row_plain(bytes(stored[r].tolist()), bits)


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_a_round_trip_is_within_half_a_step_and_zero_bytes_are_a_zero_row(bits):
    values = ragged_rows(37, 10, seed=1)
    stored = encode_rows(values.reshape(2, 5, 37), bits)  # any leading shape
    decoded = decode_rows(stored, bits).reshape(10, 37)
    step = values.abs().amax(-1, keepdim=True) / 127
    assert ((decoded - values).abs() <= step / 2 * (1 + 1e-6)).all()
    assert decoded[1].eq(0).all() and decoded[2, -1] == -3.5  # exact zeros; a row's largest value is exact
    if not bits:  # a decoded row encodes back to its bytes: a shifted conv-tail column keeps codes and scale
        assert torch.equal(encode_rows(decode_rows(stored, 0), 0), stored)
    zeros = torch.zeros(3, row_bytes(37, bits), dtype=torch.uint8)
    assert decode_rows(zeros, bits).eq(0).all()
    if bits:  # zeroed bytes carry nothing into the next write
        assert torch.equal(encode_rows(values[:3], bits, zeros), encode_rows(values[:3], bits))
    with pytest.raises(ValueError, match="residual_bits: must be one of"):
        encode_rows(values, 2)
    with pytest.raises(ValueError, match="previous: a carry needs residual_bits > 0"):
        encode_rows(values, 0, stored.reshape(10, -1))


@pytest.mark.parametrize("n", [5, 64])
def test_error_feedback_carries_what_rounding_drops_into_the_next_write(n):
    """A state read, nudged by 0.2 of a code step and written back, 40 times: without feedback every write
    rounds the nudge away and the stored value never moves; with feedback it follows the fp32 sum, within
    half a step plus what rounding the carry to 1 / 2^b of a step drops per write (at most 1 / 2^(b+1)).
    Each write's bytes equal the plain twin's, which carries the residual by hand."""
    step = 2.0 / 127
    start = torch.linspace(-1.0, 1.0, n)
    start[0] = 2.0  # the row's scale
    nudge = torch.full((n,), 0.2 * step)
    nudge[0] = 0.0
    writes = 40
    for bits in (0, 4, 8):
        stored, plain = encode_rows(start, bits), encode_row_plain(start.tolist(), bits)
        for _ in range(writes):
            value = decode_rows(stored, bits) + nudge
            stored = encode_rows(value, bits, stored if bits else None)
            plain = encode_row_plain(value.tolist(), bits, plain if bits else None)
            assert bytes(stored.tolist()) == plain
        drift = (decode_rows(stored, bits) - (start + writes * nudge))[1:].abs().max()
        if bits:
            assert drift <= step * (0.5 + writes / 2 ** (bits + 1)) * (1 + 1e-4)
        else:
            assert torch.equal(decode_rows(stored, 0)[1:], decode_rows(encode_rows(start, 0), 0)[1:])
            assert drift >= 0.5 * writes * 0.2 * step


def test_int8_slot_formats_read_and_write_ragged_slots():
    state_format, conv_format = Int8StateFormat(4), Int8ConvFormat(8)
    state_shape, conv_shape = (3, 5, 7), (24, 3)
    states, convs = state_format.allocate(6, state_shape), conv_format.allocate(6, conv_shape)
    assert states.numel() == 6 * state_format.bytes_per_slot(state_shape) == 6 * 3 * 5 * (7 + 4 + 4)
    assert convs.numel() == 6 * conv_format.bytes_per_slot(conv_shape) == 6 * 3 * 3 * (8 + 4)
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([4, 0, 3])
    state, conv = torch.randn(3, *state_shape, generator=g), torch.randn(3, *conv_shape, generator=g)
    state_format.write(states, slots, state)
    conv_format.write(convs, slots, conv)
    assert torch.equal(state_format.read(states, slots), decode_rows(encode_rows(state, 4), 4))
    columns = conv.unflatten(1, (3, 8)).transpose(-1, -2)  # per column and group of 8 channels
    expected = decode_rows(encode_rows(columns, 0), 0).transpose(-1, -2).flatten(1, 2)
    assert torch.equal(conv_format.read(convs, slots), expected)
    assert not states[[1, 2, 5]].any() and not convs[[1, 2, 5]].any()  # other slots untouched
    with pytest.raises(ValueError, match="carry_from: conv tails keep no residual"):
        conv_format.write(convs, slots, conv, carry_from=slots)
    with pytest.raises(ValueError, match="do not split into groups of 8"):
        conv_format.allocate(1, (20, 3))


# ------------------------------------------------------------------------------ the paged layer
@torch.no_grad()
@pytest.mark.parametrize("bits", [0, 4, 8])
def test_the_paged_layer_through_int8_slots_equals_the_codec_applied_to_fp32_slots(bits):
    """Prompt chunks and decodes of ragged sequences in slots out of order: outputs bitwise equal to the layer
    over fp32 slots whose rows are encoded and decoded (the state continuing each slot's carry) after every
    step; the int8 pool holds exactly those bytes."""
    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config).eval()
    layer.paged_decode = "recurrent"  # one code path for both pools, so the comparison is bitwise
    state_shape = (layer.num_heads, layer.head_dim_k, layer.head_dim_v)
    conv_shape = (layer.conv_channels, layer.conv_kernel - 1)
    group = math.gcd(layer.head_dim_k, layer.head_dim_v)
    formats = Int8StateFormat(bits), Int8ConvFormat(group)
    int8 = KDAPool(formats[0].allocate(6, state_shape), formats[1].allocate(6, conv_shape), *formats)
    plain = KDAPool(torch.zeros(6, *state_shape), torch.zeros(6, *conv_shape))
    carry: dict[int, torch.Tensor] = {}
    steps = [([0, 0, 0], [7, 1, 12], [4, 0, 2]), ([7, 1, 12], [1, 1, 1], [4, 0, 2]),
             ([8, 2, 13, 0], [1, 5, 1, 3], [4, 0, 2, 5]), ([9, 7, 14, 3], [1, 1, 1, 1], [4, 0, 2, 5])]
    g = torch.Generator().manual_seed(3)
    for context_lens, lengths, slots in steps:
        batch = ForwardBatch.from_sequences([[0] * n for n in lengths], context_lens,
                                            [[i] for i in range(len(lengths))], slots, 64)
        x = torch.randn(1, sum(lengths), config.hidden_size, generator=g)
        assert torch.equal(layer(x, batch=batch, pool=int8), layer(x, batch=batch, pool=plain))
        for slot, context in zip(slots, context_lens):
            stored = encode_rows(plain.state[slot], bits, carry[slot] if bits and context else None)
            carry[slot] = stored
            plain.state[slot] = decode_rows(stored, bits)
            columns = plain.conv[slot].unflatten(0, (-1, group)).transpose(-1, -2)
            plain.conv[slot] = decode_rows(encode_rows(columns, 0), 0).transpose(-1, -2).flatten(0, 1)
            assert torch.equal(int8.state[slot], stored)
    assert not int8.state[[1, 3]].any()


# ------------------------------------------------------------------------------ bytes
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("prefix", [False, True])
def test_planned_bytes_equal_allocated_bytes(state_dtype, prefix):
    config = ModelConfig.from_preset("tiny")
    svc = ServiceConfig.from_dict({"model": {"max_model_len": 128}, "memory": {
        "cache_bytes": 400_000, "block_size": 16, "max_num_seqs": 3, "state_dtype": state_dtype,
        **({"prefix_cache": {"snapshot_slots": 2}} if prefix else {})}})
    plan = plan_cache(config, svc)
    pools = allocate_pools(config, plan)
    allocated = pools.nbytes()
    planned = plan.bytes_by_kind()
    assert all(planned[kind] == allocated[kind] for kind in allocated)
    assert plan.total_bytes == sum(allocated.values()) <= plan.budget
    assert pools_bytes(config, svc, 0, 1) == plan.slot_bytes


def test_int8_slots_take_less_than_half_the_fp32_bytes_at_the_mini_preset():
    """Per slot and KDA layer (3 heads of 64 x 64, 576 channels, kernel 4): fp32 49,152 + 6,912 bytes; int8
    3 x 64 rows of 64 codes + 4 scale bytes + 64 x b / 8 residual bytes, conv 9 groups x 3 columns x 68."""
    config = ModelConfig.from_preset("mini")
    per_slot = {}
    for state_dtype in STATE_DTYPES:
        formats = kda_slot_formats(state_dtype, torch.float32, config.kda.head_dim_k, config.kda.head_dim_v)
        kinds = paged_pool_bytes(config, 0, 16, 1, torch.float32, None, None, *formats)
        per_slot[state_dtype] = (kinds["kda_state"], kinds["kda_conv"])
    layers = config.num_kda_layers
    assert per_slot == {"fp32": (layers * 49_152, layers * 6_912), "bf16": (layers * 24_576, layers * 3_456),
                        "int8": (layers * 3 * 64 * (68 + 8 * FEEDBACK_BITS), layers * 1_836)}
    assert sum(per_slot["fp32"]) >= 2 * sum(per_slot["int8"])


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_plan_service_tables_count_the_state_as_the_pools_store_it(state_dtype):
    """plan-service's per-sequence and offload-tier tables (service_plan, offload_plan) use the slot formats'
    own bytes: equal to one slot of pools allocated with those formats (conv tails in bf16 under fp32)."""
    config = ModelConfig.from_preset("mini")
    formats = kda_slot_formats(state_dtype, torch.bfloat16, config.kda.head_dim_k, config.kda.head_dim_v)
    kinds = paged_pool_bytes(config, 0, 16, 1, torch.float32, None, None, *formats)
    table = per_sequence_bytes(config, 1024, "fp8", state_dtype)
    tiers = request_tier_bytes(config, 1024, "fp8", None, "auto", state_dtype)
    assert (table["kda_state"], table["kda_conv"]) == (kinds["kda_state"], kinds["kda_conv"])
    assert (tiers["device: kda_state"], tiers["device: kda_conv"]) == (kinds["kda_state"], kinds["kda_conv"])


def test_tensor_parallel_shares_of_int8_rows_gather_back():
    """Whole-head int8 rows sliced into tp shares (heads; conv groups by q | k | v) and gathered back are
    the same bytes, and a share decodes to its heads' channels."""
    config = ModelConfig.from_preset("tiny")
    kda = config.kda
    formats = kda_slot_formats("int8", torch.float32, kda.head_dim_k, kda.head_dim_v)
    pools = PagedPools(config, 2, 16, 2, state_format=formats[0], conv_format=formats[1])
    g = torch.Generator().manual_seed(6)
    for pool in pools.layers:
        if isinstance(pool, KDAPool):
            pool.write_state(torch.tensor([1]), torch.randn(1, kda.num_heads, kda.head_dim_k, kda.head_dim_v,
                                                             generator=g))
            pool.write_conv(torch.tensor([1]), torch.randn(1, pool.conv.shape[1] * formats[1].group,
                                                            kda.conv_kernel - 1, generator=g))
    rows = read_request_rows(pools, torch.arange(5), 1)
    shares = [slice_heads(rows, t, 2, kda.head_dim_k, kda.head_dim_v) for t in range(2)]
    gathered = gather_heads(shares, kda.head_dim_k, kda.head_dim_v)
    assert all(torch.equal(gathered[name], rows[name]) for name in rows)
    whole = formats[1].read(rows["kda_conv"], torch.arange(len(rows["kda_conv"])))
    q, k, v = whole.split([kda.num_heads * kda.head_dim_k] * 2 + [kda.num_heads * kda.head_dim_v], dim=1)
    first = torch.cat([part.chunk(2, dim=1)[0] for part in (q, k, v)], dim=1)
    assert torch.equal(formats[1].read(shares[0]["kda_conv"], torch.arange(len(whole))), first)


# ------------------------------------------------------------------------------ moves
def test_a_pd_move_carries_the_int8_slots_byte_for_byte(model, prompts):
    """Prefill -> wire -> decode with int8 slots on both sides: the tokens of a colocated int8 engine, the decode
    pools holding the prefill side's bytes (run_1p1d checks them), the payload as planned."""
    expected = [o.token_ids for o in Engine(model, invariant_service()).generate(prompts, PARAMS, use_tqdm=False)]
    outputs, transfers = run_1p1d(Engine(model, invariant_service()), Engine(model, invariant_service()), prompts)
    assert [o.token_ids for o in outputs] == expected
    for prompt_len, payload in transfers:
        assert payload_tensor_bytes(payload) == bytes_per_request(model.config, prompt_len, "fp32", "fp32", "int8")
    assert bytes_per_request(model.config, 40, "fp32", "fp32", "int8") < bytes_per_request(model.config, 40, "fp32",
                                                                                            "fp32")
    prefill = Engine(model, service(memory=INT8))
    prefill.add_request(prompts[3], PARAMS)
    caches = []
    while not caches:
        caches = prefill_step(prefill)[1]
    with pytest.raises(ValueError, match="memory.state_dtype: the transfer was written by an instance with 'int8'"):
        import_request(Engine(model, service()), decode(encode(caches[0])))


def test_a_tensor_parallel_decode_takes_the_int8_rows_sliced_by_heads(model, prompts):
    """The worker processes plan and allocate int8 slots (their CachePlan carries the formats); a TP2 decode engine
    gets each rank's heads and conv groups of a TP1 prefill's payload and finishes with the colocated tokens."""
    chosen = [prompts[i] for i in (3, 9, 15)]
    expected = [o.token_ids for o in Engine(model, service("bf16", memory=INT8)).generate(chosen, PARAMS,
                                                                                          use_tqdm=False)]
    decode_engine = Engine(model, service("bf16", memory=INT8, tensor_parallel_size=2))
    try:
        outputs, _ = run_1p1d(Engine(model, service("bf16", memory=INT8)), decode_engine, chosen, check_pools=False)
        assert decode_engine.plan.state_format.residual_bits == FEEDBACK_BITS
    finally:
        decode_engine.close()
    assert [o.token_ids for o in outputs] == expected


def spill_int8_service(model, blocks: int, snapshots: int, spill: dict | None) -> ServiceConfig:
    """spill_cases' shared-prefix service with int8 slots: 1 running slot, `snapshots` snapshot rows, `blocks`
    blocks of 64 (the budget counted in the int8 formats), batch-invariant."""
    data = {"model": {"max_model_len": 512},
            "memory": {"block_size": 64, "max_num_seqs": 1, "state_dtype": "int8",
                       "prefix_cache": {"snapshot_slots": snapshots} | (spill or {})},
            "scheduler": {"prefill_chunk_size": 512, "batch_invariant": True, "max_batch_size": 4}}
    probe = ServiceConfig.from_dict(data)
    block, slot = pools_bytes(model.config, probe, 1, 0), pools_bytes(model.config, probe, 0, 1)
    data["memory"]["cache_bytes"] = (1 + snapshots) * slot + blocks * block
    return ServiceConfig.from_dict(data)


@pytest.mark.parametrize("tier, prefix_cache", [("host", {"host_bytes": 1 << 20}), ("disk", {"host_bytes": 0})])
def test_a_spilled_int8_snapshot_gives_the_logits_of_a_device_hit(model, tmp_path, tier, prefix_cache):
    """Three 4-block prefixes in turn through 9 device blocks: every second visit restores its blocks and int8
    snapshot from the host or disk tier; a device holding them all hits there. Same logits, bitwise."""
    from spill_cases import serve

    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 256, (256,), generator=g).tolist() for _ in range(3)]
    chosen = [prefixes[i % 3] + [i + 1] for i in range(6)]
    spilled = Engine(model, spill_int8_service(model, 9, 2, prefix_cache | {"disk_dir": str(tmp_path)}))
    roomy = Engine(model, spill_int8_service(model, 40, 6, None))
    (tokens, rows), (expected_tokens, expected_rows) = serve(spilled, chosen), serve(roomy, chosen)
    assert tokens == expected_tokens and all(torch.equal(a, b) for a, b in zip(rows, expected_rows))
    assert spilled.stats()[f"prefix_hits_{tier}"] == 3
    assert spilled.stats()["prefix_hit_tokens"] == roomy.stats()["prefix_hit_tokens"] == 3 * 256


def test_a_preempted_int8_request_gives_the_tokens_of_an_unpreempted_one(model):
    """A preemption is a recompute (its prompt and generated tokens as prefill chunks), not a move of bytes: the
    tokens agree with a roomy int8 engine's."""
    g = torch.Generator().manual_seed(1)
    chosen = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (100, 150, 200, 255, 64, 31)]
    params = SamplingParams(max_tokens=6)

    def engine(blocks):
        data = {"model": {"max_model_len": 512}, "memory": {"block_size": 16, "max_num_seqs": 8, "state_dtype": "int8"},
                "scheduler": {"prefill_chunk_size": 256}}
        probe = ServiceConfig.from_dict(data)
        data["memory"]["cache_bytes"] = 8 * pools_bytes(model.config, probe, 0, 1) + blocks * pools_bytes(
            model.config, probe, 1, 0)
        return Engine(model, ServiceConfig.from_dict(data))

    tight, roomy = engine(40), engine(200)
    tokens = [o.token_ids for o in tight.generate(chosen, params, use_tqdm=False)]
    assert tight.stats()["preemptions"] > 0
    assert tokens == [o.token_ids for o in roomy.generate(chosen, params, use_tqdm=False)]
    assert roomy.stats()["preemptions"] == 0


@torch.no_grad()
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_verify_step_over_stored_slots_leaves_the_states_of_plain_decodes(state_dtype):
    """One verify step of K = 3 drafts in a KDA layer whose slots store bf16 or int8: spec slot j holds, byte for
    byte, what decoding x0, d1 .. dj one token at a time leaves (the state continues the previous token's
    carry and is read back before the next token; a later token's conv taps meet earlier ones as stored), and
    the outputs are the decodes' (GEMMs row-invariant, ops/batch_invariant.py)."""
    from latentmoe_lab.ops.batch_invariant import batch_invariant_mode

    config = ModelConfig.from_preset("tiny")
    layer = KimiDeltaAttention(config).eval()
    kda = config.kda
    formats = kda_slot_formats(state_dtype, torch.float32, kda.head_dim_k, kda.head_dim_v)
    shapes = ((layer.num_heads, layer.head_dim_k, layer.head_dim_v), (layer.conv_channels, layer.conv_kernel - 1))
    spec_pool, plain_pool = (KDAPool(*(f.allocate(7, shape) for f, shape in zip(formats, shapes)), *formats)
                             for _ in range(2))
    g = torch.Generator().manual_seed(8)
    k, hidden = 3, config.hidden_size
    prompt = torch.randn(1, 13, hidden, generator=g)
    with batch_invariant_mode():
        for pool in (spec_pool, plain_pool):  # a 13-token prompt into slot 1
            layer(prompt, batch=ForwardBatch.from_sequences([[0] * 13], [0], [[0]], [1], 64), pool=pool)
        x = torch.randn(1, k + 2, hidden, generator=g)  # a decode of another sequence (slot 0), then x0, d1 .. d3
        verify = ForwardBatch.from_sequences([[0], [0] * (k + 1)], [4, 13], [[1], [0]], [0, 1], 64)
        verify.decode = torch.tensor([True, False])
        verify.spec_slots = torch.tensor([[-1] * (k + 1), [1, 5, 2, 6]])
        out = layer(x, batch=verify, pool=spec_pool)
        for j in range(k + 1):
            step = ForwardBatch.from_sequences([[0]], [13 + j], [[0]], [1], 64)
            step.decode = torch.tensor([True])
            assert torch.equal(layer(x[:, 1 + j:2 + j], batch=step, pool=plain_pool)[0, 0], out[0, 1 + j])
            slot = int(verify.spec_slots[1, j])
            assert torch.equal(spec_pool.state[slot], plain_pool.state[1]), f"state after token {j}"
            assert torch.equal(spec_pool.conv[slot], plain_pool.conv[1]), f"conv tail after token {j}"


# ------------------------------------------------------------------------------ refusals
def test_config_refusals_name_the_key_and_allocate_nothing(model, tmp_path, monkeypatch):
    from latentmoe_lab.serving.service_plan import load_service_config

    assert service_config.STATE_DTYPES == STATE_DTYPES
    allocated = []
    monkeypatch.setattr(PagedPools, "__init__", lambda self, *a, **k: allocated.append(a))
    path = tmp_path / "service.yaml"
    path.write_text("model: {preset: tiny, max_model_len: 64}\nmemory: {state_dtype: int4, cache_bytes: 400000}\n")
    with pytest.raises(ValueError, match=r"memory.state_dtype: .*'int4'"):
        load_service_config(path)
    good = ServiceConfig.from_dict({"model": {"max_model_len": 64}, "memory": {"cache_bytes": 400_000}})
    bad = dataclasses.replace(good, memory=dataclasses.replace(good.memory, state_dtype="int4"))  # unvalidated
    with pytest.raises(ValueError, match="memory.state_dtype: must be one of"):
        Engine(model, bad)
    with pytest.raises(ValueError, match="memory.state_dtype: must be one of"):
        kda_slot_formats("fp16", torch.float32, 16, 16)
    with pytest.raises(ValueError, match=r"disaggregation.decode.memory.state_dtype: 'int8' differs"):
        ServiceConfig.from_dict({"model": {"preset": "tiny"}, "disaggregation": {
            "prefill_instances": 1, "decode_instances": 1, "decode": {"memory": {"state_dtype": "int8"}}}})
    assert allocated == []
    assert ServiceConfig.from_dict({}).memory.state_dtype == "fp32"  # the default keeps today's pools
