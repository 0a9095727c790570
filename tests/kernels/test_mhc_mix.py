import pytest
import torch

from deepinfer.kernels.mhc_mix import mhc_mix, reference, split_count
from deepinfer.layers.norm import rms_norm
from interpreter import SHIMS, run_interpreted


def test_split_count_divides_k_into_power_of_two_splits():
    for T in (1, 3, 64, 8192):
        s = split_count(T, 16384)
        assert 1 <= s and 16384 % (s * 64) == 0 and s & (s - 1) == 0
    assert split_count(1, 16384) == 128 > split_count(8192, 16384)


def test_reference_is_the_normalised_projection():
    g = torch.Generator().manual_seed(0)
    x, fn = torch.randn(5, 256, generator=g), torch.randn(24, 256, generator=g)
    torch.testing.assert_close(reference(x, fn, 1e-6), rms_norm(x, 1e-6) @ fn.t(), atol=1e-4, rtol=1e-4)
    assert torch.equal(mhc_mix(x, fn, 1e-6), reference(x, fn, 1e-6))  # CPU: the reference itself


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 17, 64, 1000, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_on_gpu(T, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    K = 4 * 4096
    x = (torch.randn(T, K, generator=g, device="cuda") * 2).to(dtype)
    fn = torch.randn(24, K, generator=g, device="cuda") * 0.01
    want = reference(x, fn, 1e-6)
    for s in (None, 1, 8):
        torch.testing.assert_close(mhc_mix(x, fn, 1e-6, s), want, atol=1e-5, rtol=1e-4)


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.mhc_mix import _launch, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "fn = torch.randn(24, 256, generator=g)\n"
        "for T, s in ((1, 1), (3, 2), (37, 4), (40, 1)):\n"
        "    x = torch.randn(T, 256, generator=g)\n"
        "    torch.testing.assert_close(_launch(x, fn, 1e-6, s), reference(x, fn, 1e-6), atol=1e-4, rtol=1e-4)\n"
        "    xb = x.to(torch.bfloat16)\n"
        "    torch.testing.assert_close(_launch(xb, fn, 1e-6, s), reference(xb, fn, 1e-6), atol=1e-4, rtol=1e-4)\n"
        "print('ok')\n")
    run_interpreted(code)
