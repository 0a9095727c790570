import pytest
import torch

from deepinfer.kernels.rms_norm import reference, rms_norm
from deepinfer.layers.norm import RMSNorm
from interpreter import run_interpreted

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def test_cpu_falls_back_to_the_reference():
    x = torch.randn(5, 80, dtype=torch.bfloat16)
    w = torch.rand(80) + 0.5
    assert torch.equal(rms_norm(x, 1e-6, w), reference(x, 1e-6, w))
    assert rms_norm(x, 1e-6, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 512), (37, 512), (37, 64, 512), (3, 80), (37, 4096), (2, 7168),
                                   (5, 1536), (4, 28672), (1, 3), (37, 3, 80)])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_matches_reference_on_gpu(dtype, shape, weighted):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    w = torch.rand(shape[-1], generator=g, device="cuda") + 0.5 if weighted else None
    for out_dtype in (None, torch.float32):
        got = rms_norm(x, 1e-6, w, out_dtype)
        want = reference(x, 1e-6, w, out_dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL[got.dtype])


@pytest.mark.gpu
def test_kernel_takes_strided_rows_and_the_module_dispatches():
    g = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn(37, 1024, generator=g, device="cuda").to(torch.bfloat16)
    x = big[:, 100:612]                                  # row stride 1024, width 512
    torch.testing.assert_close(rms_norm(x, 1e-6), reference(x, 1e-6), **TOL[torch.bfloat16])
    norm = RMSNorm(512, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        want = (reference(x, 1e-6) * norm.weight).to(x.dtype)
        torch.testing.assert_close(norm(x), want, **TOL[torch.bfloat16])


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from deepinfer.kernels.rms_norm import _launch, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for shape in [(1, 80), (5, 80), (2, 3, 16)]:\n"
        "    x = torch.randn(shape, generator=g) * 3\n"
        "    w = torch.rand(shape[-1], generator=g) + .5\n"
        "    for weight in (None, w):\n"
        "        for mb in (8192, 32):\n"  # single pass; three 32-wide chunks (two-pass loop)
        "            got = _launch(x, 1e-6, weight, None, max_block=mb)\n"
        "            torch.testing.assert_close(got, reference(x, 1e-6, weight), atol=1e-5, rtol=1e-5)\n"
        "big = torch.randn(5, 100, generator=g)\n"  # strided rows
        "torch.testing.assert_close(_launch(big[:, 10:90], 1e-6, None, None), reference(big[:, 10:90], 1e-6),\n"
        "                           atol=1e-5, rtol=1e-5)\n"
        "xb = x.to(torch.bfloat16)\n"  # the interpreter truncates fp32 -> bf16 (GPU rounds to nearest): 1 ulp
        "torch.testing.assert_close(_launch(xb, 1e-6, w, None), reference(xb, 1e-6, w), atol=1e-2, rtol=1e-2)\n"
        "print('ok')\n")
    run_interpreted(code)
