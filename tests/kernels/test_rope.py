import pytest
import torch

from deepinfer.kernels.rope import reference, rope
from deepinfer.layers.norm import rms_norm
from deepinfer.layers.rotary import RopeCache, apply_rope, norm_rope, rope_inv_freq
from interpreter import run_interpreted

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _cache(N: int, rope_dim: int, device: str) -> RopeCache:
    pos = torch.randint(0, 100_000, (N,), generator=torch.Generator().manual_seed(N)).to(device)
    return RopeCache.at(pos, rope_inv_freq(rope_dim, 10000.0).to(device))


@pytest.mark.parametrize("inverse", [False, True])
def test_reference_is_apply_rope_and_cpu_falls_back(inverse):
    x = torch.randn(7, 3, 80).to(torch.bfloat16)
    rc = _cache(7, 16, "cpu")
    want = apply_rope(x, rc, inverse)
    assert torch.equal(reference(x, rc.cos, rc.sin, inverse), want)
    assert torch.equal(rope(x, rc.cos, rc.sin, inverse), want)
    normed = apply_rope(rms_norm(x, 1e-6).to(x.dtype), rc, inverse)
    assert torch.equal(reference(x, rc.cos, rc.sin, inverse, 1e-6), normed)
    if not inverse:
        assert torch.equal(norm_rope(x, 1e-6, rc), normed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,heads,D,R", [(1, (64,), 512, 64), (37, (64,), 512, 64), (37, (), 512, 64),
                                         (37, (3,), 80, 16), (5, (2, 3), 80, 12), (4, (8,), 64, 64)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("norm_eps", [None, 1e-6])
def test_kernel_matches_reference_on_gpu(dtype, N, heads, D, R, inverse, norm_eps):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn((N, *heads, D), generator=g, device="cuda") * 3).to(dtype)
    rc = _cache(N, R, "cuda")
    got = rope(x, rc.cos, rc.sin, inverse, norm_eps)
    want = reference(x, rc.cos, rc.sin, inverse, norm_eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    if norm_eps is None:   # the nope channels are copied bit for bit
        assert torch.equal(got[..., : D - R], x[..., : D - R])


@pytest.mark.gpu
@pytest.mark.parametrize("N,heads,D,R", [(1, (64,), 512, 64), (37, (64,), 512, 64), (37, (), 512, 64),
                                         (5, (2, 3), 80, 12)])
@pytest.mark.parametrize("inverse", [False, True])
def test_in_place_kernel_on_gpu(N, heads, D, R, inverse):
    """In place: the same bits as the out-of-place kernel, written into x itself."""
    x = (torch.randn((N, *heads, D), generator=torch.Generator(device="cuda").manual_seed(1), device="cuda") * 3
         ).to(torch.bfloat16)
    rc = _cache(N, R, "cuda")
    want = rope(x, rc.cos, rc.sin, inverse)
    got = rope(x, rc.cos, rc.sin, inverse, inplace=True)
    assert got.data_ptr() == x.data_ptr() and torch.equal(got, want)
    y = x.clone()
    assert torch.equal(apply_rope(y, rc, inverse, overwrite=True), apply_rope(x.clone(), rc, inverse))


@pytest.mark.gpu
def test_wired_paths_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(2)
    big = torch.randn(37, 64, 600, generator=g, device="cuda").to(torch.bfloat16)
    x = big[..., :512]                                   # strided heads/tokens
    rc = _cache(37, 64, "cuda")
    torch.testing.assert_close(apply_rope(x, rc), reference(x, rc.cos, rc.sin), **TOL[torch.bfloat16])
    torch.testing.assert_close(apply_rope(x, rc, inverse=True), reference(x, rc.cos, rc.sin, True),
                               **TOL[torch.bfloat16])
    want = reference(rms_norm(x, 1e-6).to(x.dtype), rc.cos, rc.sin)
    torch.testing.assert_close(norm_rope(x, 1e-6, rc), want, **TOL[torch.bfloat16])


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from deepinfer.kernels.rope import _launch, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for N, heads, D, R in [(1, (3,), 80, 16), (5, (), 24, 12), (4, (2,), 16, 16)]:\n"
        "    x = torch.randn((N, *heads, D), generator=g) * 3\n"
        "    ang = torch.rand(N, R // 2, generator=g) * 6\n"
        "    cos, sin = ang.cos(), ang.sin()\n"
        "    for inverse in (False, True):\n"
        "        for eps in (None, 1e-6):\n"
        "            got = _launch(x, cos, sin, inverse, eps)\n"
        "            torch.testing.assert_close(got, reference(x, cos, sin, inverse, eps), atol=1e-5, rtol=1e-5)\n"
        "big = torch.randn(5, 3, 100, generator=g)\n"  # strided rows
        "xs = big[..., 10:90]\n"
        "ang = torch.rand(5, 8, generator=g) * 6\n"
        "torch.testing.assert_close(_launch(xs, ang.cos(), ang.sin(), True, 1e-6),\n"
        "                           reference(xs, ang.cos(), ang.sin(), True, 1e-6), atol=1e-5, rtol=1e-5)\n"
        "xb = xs.to(torch.bfloat16)\n"  # the interpreter truncates fp32 -> bf16 (GPU rounds to nearest): 1 ulp
        "torch.testing.assert_close(_launch(xb, ang.cos(), ang.sin(), False, None),\n"
        "                           reference(xb, ang.cos(), ang.sin()), atol=1e-2, rtol=1e-2)\n"
        "for N, heads, D, R in [(5, (3,), 80, 16), (70, (), 24, 12)]:\n"  # in place: only rope channels change
        "    x = torch.randn((N, *heads, D), generator=g) * 3\n"
        "    ang = torch.rand(N, R // 2, generator=g) * 6\n"
        "    want, before = reference(x, ang.cos(), ang.sin(), True), x.clone()\n"
        "    got = _launch(x, ang.cos(), ang.sin(), True, None, inplace=True)\n"
        "    assert got.data_ptr() == x.data_ptr()\n"
        "    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)\n"
        "    assert torch.equal(x[..., : D - R], before[..., : D - R])\n"
        "print('ok')\n")
    run_interpreted(code)
