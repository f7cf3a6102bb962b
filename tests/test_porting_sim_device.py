"""The simulated accelerator (latentmoe_lab.porting.sim_device): bitwise CPU parity with the fp32 profile, the
bf16-accumulation profile as an alignment candidate, strict and report modes, and bad profiles / tables."""
import pytest
import torch

from latentmoe_lab.alignment import compare
from latentmoe_lab.porting.op_table import FULL_OP_TABLE, MATMUL_OPS, NumericsProfile
from latentmoe_lab.porting.sim_device import _FACTOR_POSITION, SimDevice, SimDeviceCandidate, UnsupportedOperator
from latentmoe_lab.porting.swap import use_custom_ops


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 200, (2, 37), generator=torch.Generator().manual_seed(1))


def test_full_op_table_and_fp32_profile_equal_the_cpu_bit_for_bit(model, ids):
    with torch.no_grad():
        expected = model(ids).logits
        device = SimDevice("fp32", mode="strict", model=model)
        with device:
            got = model(ids).logits
    assert torch.equal(got, expected)
    assert device.coverage().missing == {} and device.ops_run > 500


def test_bf16_accumulation_profile_is_an_alignment_candidate_with_a_named_first_divergence(model, ids):
    strict = {"rel_l2": 1e-4}
    bf16 = compare(model, SimDeviceCandidate(model, "bf16-accum-fp32"), ids, thresholds=strict)
    assert bf16.first_divergence is not None and bf16.first_divergence.name == "layers.0.attn"
    assert "rel_l2" in bf16.first_divergence.exceeded
    fp32 = compare(model, SimDeviceCandidate(model, "fp32"), ids, thresholds=strict)
    assert fp32.first_divergence is None


def _bf16(t):
    return t.to(torch.bfloat16).float()


def test_bf16_profile_writes_out_buffers_and_in_place_results_with_rounded_factors_only():
    # the KDA state recurrence calls baddbmm(out=<torch.empty buffer>) and baddbmm_: both must land in the
    # caller's tensor (rounding a copy of them once left the buffer uninitialised: NaN, run to run)
    gen = torch.Generator().manual_seed(3)
    c, a, b = (torch.randn(2, 5, 7, generator=gen), torch.randn(2, 5, 3, generator=gen),
               torch.randn(2, 3, 7, generator=gen))
    expected = c - _bf16(a) @ _bf16(b)  # fp32 accumulator, bf16-rounded factors
    out = torch.full_like(c, float("nan"))
    in_place, mm_out = c.clone(), torch.full((5, 7), float("nan"))
    with SimDevice("bf16-accum-fp32"):
        torch.baddbmm(c, a, b, alpha=-1.0, out=out)
        in_place.baddbmm_(a, b, alpha=-1.0)
        torch.mm(a[0], b[0], out=mm_out)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(in_place, expected)
    torch.testing.assert_close(mm_out, _bf16(a[0]) @ _bf16(b[0]))
    assert set(_FACTOR_POSITION) == MATMUL_OPS  # every rounded op says where its two factors are


def test_bf16_profile_is_deterministic_and_close_past_one_kda_chunk(model):
    ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))  # 4 KDA chunks
    candidate = SimDeviceCandidate(model, "bf16-accum-fp32")
    with torch.no_grad():
        first, second, expected = candidate(ids).logits, candidate(ids).logits, model(ids).logits
    assert torch.equal(first, second)
    assert float((first - expected).norm() / expected.norm()) < 0.1  # bf16 factors, not garbage


def test_strict_mode_names_the_missing_op_its_shapes_and_module(model, ids):
    with pytest.raises(UnsupportedOperator) as error, torch.no_grad():
        with SimDevice("fp32", op_table=FULL_OP_TABLE - {"aten.linalg_solve_triangular"}, model=model):
            model(ids)
    assert (error.value.op, error.value.module) == ("aten.linalg_solve_triangular", "layers.0.attn")
    kda = model.layers[0].attn  # the first KDA chunk group's solve: [chunks, B * heads, C, C]
    chunks = -(-37 // kda.chunk_size)
    assert error.value.shapes[0] == (chunks, 2 * kda.num_heads, kda.chunk_size, kda.chunk_size)
    assert "not in the op table" in str(error.value)


def test_report_mode_falls_back_and_counts_custom_ops_as_one_op(model, ids):
    device = SimDevice("fp32", op_table=FULL_OP_TABLE - {"latentmoe.kda_chunk"}, mode="report", model=model)
    with torch.no_grad(), use_custom_ops(), device:
        got = model(ids).logits
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    coverage = device.coverage()
    kda_layers = model.config.num_kda_layers
    assert coverage.missing == {"latentmoe.kda_chunk": kda_layers} and coverage.layers["latentmoe.kda_chunk"] == ["kda"]
    assert coverage.host_round_trips == kda_layers and "latentmoe.kda_chunk" in coverage.summary()


def test_a_limited_profile_reports_int64_and_top_k_limits(model, ids):
    limited = NumericsProfile("no-int64", dtypes=("float32", "bool", "int32"), topk_max_k=1)
    device = SimDevice(limited, mode="report", model=model)
    with torch.no_grad(), device:
        model(ids)
    coverage = device.coverage()
    assert "aten.topk" in coverage.missing and "latent_moe" in coverage.layers["aten.topk"]
    assert "int64" in coverage.reasons["aten.embedding"] and coverage.supported_fraction < 1


def test_fp8_casts_saturate_or_give_nan_as_the_profile_says():
    values = torch.tensor([1000.0, -3000.0, 3.0])
    with SimDevice(NumericsProfile("sat", fp8_saturate=True)):
        saturated = values.to(torch.float8_e4m3fn)
    with SimDevice(NumericsProfile("nan", fp8_saturate=False)):
        overflowed = values.to(torch.float8_e4m3fn)
    assert saturated.float().tolist() == [448.0, -448.0, 3.0]
    assert overflowed.float()[:2].isnan().all() and float(overflowed.float()[2]) == 3.0


def test_bad_profiles_tables_and_modes_are_one_line_errors():
    with pytest.raises(ValueError, match="dtypes: unknown dtype 'float99'"):
        NumericsProfile("x", dtypes=("float32", "float99"))
    with pytest.raises(ValueError, match="matmul_inputs: unknown dtype"):
        NumericsProfile("x", matmul_inputs="bf17")
    with pytest.raises(ValueError, match="op_table: unknown op 'aten.not_an_op'"):
        SimDevice("fp32", op_table={"aten.mm", "aten.not_an_op"})
    with pytest.raises(ValueError, match="profile: expected a NumericsProfile or one of"):
        SimDevice("fp31")
    with pytest.raises(ValueError, match="mode: must be one of"):
        SimDevice("fp32", mode="lenient")
