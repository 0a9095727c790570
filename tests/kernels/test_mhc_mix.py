import pytest
import torch

from deepinfer.kernels.mhc_mix import mhc_mix, reference, split_count
from deepinfer.layers.norm import rms_norm
from interpreter import SHIMS, interpreted_and_gpu, run_interpreted


def test_split_count_divides_k_into_power_of_two_splits():
    for K in (384, 640, 1536, 16384):  # the tiny test models' n * D as well as V4-Flash's
        for T in (1, 3, 64, 8192):
            s = split_count(T, K)
            assert 1 <= s and K % (s * 64) == 0 and s & (s - 1) == 0, (T, K, s)
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


FIXED_ROWS_CHECK = (
    "import torch\n"
    "from deepinfer.kernels.mhc_mix import fixed_splits, mhc_mix, _launch\n"
    "g = torch.Generator().manual_seed(0)\n"
    "fn = (torch.randn(24, K, generator=g) * 0.01).to(DEV)\n"
    "x = (torch.randn(70, K, generator=g) * 2).to(torch.bfloat16).to(DEV)\n"
    "assert fixed_splits(K) > 1\n"
    "run = (lambda t: mhc_mix(t, fn, 1e-6, fixed=True)) if DEV == 'cuda' else \\\n"
    "    (lambda t: _launch(t, fn, 1e-6, fixed_splits(K), 16))\n"
    "full = run(x)\n"
    "for lo, hi in ((0, 1), (5, 6), (3, 40), (17, 70)):\n"  # a row's bits do not depend on its neighbours
    "    assert torch.equal(run(x[lo:hi]), full[lo:hi]), (lo, hi)\n"
    "print('ok')\n")


# The interpreter's tl.dot is numpy's float32 matmul, whose BLAS may round a row by its place in the tile (it did
# on an AMD EPYC host): there the check runs on a dot that computes each row from that row alone, in K order, so
# what it checks is the kernel's tiling and split order, as the compiled check does on the GPU.
ROW_LOCAL_DOT = (
    "import numpy as np\n"
    "import triton.runtime.interpreter as ti\n"
    "def _row_dot(self, a, b, d, *rest):\n"
    "    prod = (a.data.astype(np.float32)[:, :, None] * b.data.astype(np.float32)[None, :, :]).sum(1)\n"
    "    return ti.TensorHandle(prod.astype(d.data.dtype) + d.data, d.dtype.scalar)\n"
    "ti.InterpreterBuilder.create_dot = _row_dot\n")

test_fixed_mode_rows_do_not_depend_on_the_batch_in_the_triton_interpreter, \
    test_fixed_mode_rows_do_not_depend_on_the_batch_on_gpu = interpreted_and_gpu(
        FIXED_ROWS_CHECK, ROW_LOCAL_DOT + "K, DEV = 1024, 'cpu'\n", "K, DEV = 16384, 'cuda'\n")


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
