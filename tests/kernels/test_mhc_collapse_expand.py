"""mHC collapse (+ RMSNorm) and expand kernels against their torch references."""
import pytest
import torch

from deepinfer.kernels import mhc_collapse, mhc_expand
from deepinfer.layers import mhc
from deepinfer.layers.norm import RMSNorm
from interpreter import run_interpreted


def _inputs(T, n, D, device, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(T, n, D, generator=g, device=device) * 2).to(dtype)
    y = torch.randn(T, D, generator=g, device=device).to(dtype)
    pre = torch.rand(T, n, generator=g, device=device)
    post = torch.rand(T, n, generator=g, device=device) * 2
    comb = torch.softmax(torch.randn(T, n, n, generator=g, device=device), -1)
    w = torch.rand(D, generator=g, device=device) + 0.5
    return x, y, pre, post, comb, w


def test_references_match_the_layer_functions_on_the_cpu():
    x, y, pre, post, comb, w = _inputs(5, 4, 64, "cpu", torch.float32)
    assert torch.equal(mhc_collapse.reference(x, pre), mhc.collapse(x, pre))
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(mhc_collapse.reference(x, pre, w, 1e-6), mhc.collapse_norm(x, pre, norm))
    torch.testing.assert_close(mhc_expand.reference(x, y, post, comb), mhc.expand(x, y, post, comb))


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 4096), (7, 4096), (300, 4096), (3, 80)])
def test_kernels_match_references_on_gpu(T, D):
    x, y, pre, post, comb, w = _inputs(T, 4, D, "cuda")
    tol = dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(mhc_collapse.mhc_collapse(x, pre), mhc_collapse.reference(x, pre), **tol)
    torch.testing.assert_close(mhc_collapse.mhc_collapse(x, pre, w, 1e-6), mhc_collapse.reference(x, pre, w, 1e-6),
                               **tol)
    torch.testing.assert_close(mhc_expand.mhc_expand(x, y, post, comb), mhc_expand.reference(x, y, post, comb), **tol)


def test_kernels_match_references_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from deepinfer.kernels import mhc_collapse as c, mhc_expand as e\n"
        "from test_mhc_collapse_expand import _inputs\n"
        "for T, D in ((1, 64), (5, 80)):\n"
        "    x, y, pre, post, comb, w = _inputs(T, 4, D, 'cpu', torch.float32)\n"
        "    torch.testing.assert_close(c._launch(x, pre, None, 0.0), c.reference(x, pre))\n"
        "    torch.testing.assert_close(c._launch(x, pre, w, 1e-6), c.reference(x, pre, w, 1e-6))\n"
        "    torch.testing.assert_close(e._launch(x, y, post, comb), e.reference(x, y, post, comb))\n"
        "print('ok')\n")
    run_interpreted(code)
