"""The fixed-tiling GEMM behind batch-invariant mode on CUDA: a row's bits never depend on M."""
import pytest
import torch

from deepinfer.kernels.invariant_matmul import matmul, reference, splits
from deepinfer.layers import invariant
from interpreter import SHIMS, run_interpreted


def test_cpu_uses_the_reference():
    x, w = torch.randn(3, 2, 40), torch.randn(24, 40)
    assert torch.equal(matmul(x, w), reference(x.reshape(-1, 40), w).view(3, 2, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                              (torch.float32, None)])
@pytest.mark.parametrize("N, K", [(1, 7), (200, 1000), (4096, 512), (1024, 4096), (24, 16384)])  # last 3 split K
def test_rows_are_bit_identical_whatever_m_on_gpu(dtype, out_dtype, N, K):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, K, generator=g, device="cuda").to(dtype)
    w = torch.randn(N, K, generator=g, device="cuda").to(dtype)
    full = matmul(x, w, out_dtype)
    tol = dict(atol=1e-3, rtol=1e-3) if full.dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(full.float(), reference(x, w, out_dtype).float(), **tol)
    for lo, hi in ((7, 8), (0, 1), (5, 70), (64, 65), (250, 300)):
        assert torch.equal(matmul(x[lo:hi], w, out_dtype), full[lo:hi]), (lo, hi)


@pytest.mark.gpu
def test_invariant_sum_rows_do_not_depend_on_the_batch_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(500, 6, 128, generator=g, device="cuda")
    with invariant.mode(True):
        full = invariant.reduce_sum(x, 1)
        torch.testing.assert_close(full, x.sum(1), atol=1e-5, rtol=1e-5)
        for lo, hi in ((3, 4), (0, 33), (100, 500)):
            assert torch.equal(invariant.reduce_sum(x[lo:hi], 1), full[lo:hi])


def test_splits_depend_on_n_and_k_only():
    assert splits(4096, 512) == 4 and splits(1024, 4096) == 8 and splits(32768, 1024) == 1
    assert splits(24, 16384) == 8 and splits(1, 7) == 1 and splits(1024, 4096 + 32) == 1


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +  # split-K loops have runtime bounds
        "import torch\n"
        "from deepinfer.kernels.invariant_matmul import _launch, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for M, N, K in ((1, 5, 40), (70, 65, 33)):\n"
        "    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)\n"
        "    torch.testing.assert_close(_launch(x, w), reference(x, w), atol=1e-4, rtol=1e-4)\n"
        "x, w = torch.randn(5, 256, generator=g), torch.randn(70, 256, generator=g)\n"
        "for S in (2, 4):\n"  # split K, fp32 partials summed in split order
        "    torch.testing.assert_close(_launch(x, w, n_splits=S), reference(x, w), atol=1e-4, rtol=1e-4)\n"
        "    torch.testing.assert_close(_launch(x, w, torch.float32, n_splits=S), reference(x, w, torch.float32),\n"
        "                               atol=1e-4, rtol=1e-4)\n"
        "print('ok')\n")
    run_interpreted(code)
