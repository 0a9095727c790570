import pytest
import torch

from deepinfer.kernels.mhc_coeffs import mhc_coeffs, reference
from interpreter import run_interpreted



def _inputs(T: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    mix = torch.randn(T, 24, generator=g, device=device) * 3
    return mix, torch.randn(24, generator=g, device=device) * 0.5, torch.rand(3, generator=g, device=device) + 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 63, 64, 1000])
def test_kernel_matches_reference_on_gpu(T):
    args = _inputs(T, "cuda")
    for got, want in zip(mhc_coeffs(*args, 4, 20, 1e-6), reference(*args, 4, 20, 1e-6)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch, triton\n"
        "from deepinfer.kernels.mhc_coeffs import _mhc_kernel, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "mix = torch.randn(70, 24, generator=g) * 3; base = torch.randn(24, generator=g) * .5\n"
        "scale = torch.rand(3, generator=g) + .5\n"
        "pre, post, comb = torch.empty(70, 4), torch.empty(70, 4), torch.empty(70, 4, 4)\n"
        "_mhc_kernel[(triton.cdiv(70, 64),)](mix, base, scale, pre, post, comb, 70, 1e-6, N=4, ITERS=20, BLOCK=64)\n"
        "for a, b in zip((pre, post, comb), reference(mix, base, scale, 4, 20, 1e-6)):\n"
        "    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)\n"
        "print('ok')\n")
    run_interpreted(code)
