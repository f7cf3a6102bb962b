"""The dequantizing grouped GEMM (latentmoe_kernels.dequant_gemm) against the packed experts' torch twin."""
import pytest
import torch

pytest.importorskip("triton")

from latentmoe_lab.layers.moe import LatentExperts  # noqa: E402
from latentmoe_lab.quant import QuantLatentExperts  # noqa: E402
from latentmoe_lab.quant.activations import ActivationQuantizer  # noqa: E402
from latentmoe_lab.quant.linear import WEIGHT_FORMATS  # noqa: E402


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("counts", [[5, 0, 17, 3], [0, 0, 1, 0]])
def test_kernel_equals_dequantize_then_matmul(fmt, counts):
    from latentmoe_kernels.dequant_gemm import dequant_grouped_gemm

    counts = torch.tensor(counts)
    d_out, d_in = 150, 72  # ragged: not multiples of 128 (fp8 blocks), 72 = 2 MX blocks + 8
    weights = torch.randn(4, d_out, d_in)
    weights[2, :, 5] *= 1e-3  # tiny values reach e4m3's subnormals after scaling
    packed = WEIGHT_FORMATS[fmt].pack(weights)
    x = torch.randn(int(counts.sum()), d_in)
    dense = WEIGHT_FORMATS[fmt].unpack(packed)[..., :d_in]
    starts = [0] + counts.cumsum(0).tolist()[:-1]
    reference = torch.cat([x[s:s + c] @ dense[e].T for e, (s, c) in enumerate(zip(starts, counts.tolist()))])
    out = dequant_grouped_gemm(x, packed["data"], packed["scale"], counts.cumsum(0), fmt, d_in)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_packed_experts_on_the_triton_backend_equal_the_torch_path(fmt):
    experts = LatentExperts(5, 40, 24, activation_clamp=1.5)
    torch.nn.init.normal_(experts.w13, std=0.2)
    torch.nn.init.normal_(experts.w2, std=0.2)
    quant = QuantLatentExperts.from_experts(experts, fmt, ActivationQuantizer("dynamic", "int8", 40),
                                            ActivationQuantizer("dynamic", "int8", 24))
    counts = torch.tensor([3, 0, 9, 1, 0])
    z = torch.randn(13, 40)
    expected = quant(z, counts)
    quant.backend = "triton"
    torch.testing.assert_close(quant(z, counts), expected, rtol=1e-5, atol=1e-5)
