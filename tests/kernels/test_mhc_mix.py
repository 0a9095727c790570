import pytest
import torch

from deepinfer.kernels.mhc_mix import mix_partials, reference, split_count
from deepinfer.layers.norm import rms_norm
from interpreter import run_interpreted


def test_split_count_divides_k_into_whole_blocks():
    for T in (1, 3, 64, 8192):
        s = split_count(T, 16384)
        assert 1 <= s and 16384 % (s * 64) == 0
    assert split_count(1, 16384) > split_count(8192, 16384) == 1


def test_reference_partials_give_the_normalised_projection():
    g = torch.Generator().manual_seed(0)
    x, fn = torch.randn(5, 256, generator=g), torch.randn(24, 256, generator=g)
    for s in (1, 4):
        part, sq = reference(x, fn, s)
        assert part.shape == (s, 5, 24) and sq.shape == (s, 5)
        mix = part.sum(0) * torch.rsqrt(sq.sum(0) / 256 + 1e-6)[:, None]
        torch.testing.assert_close(mix, rms_norm(x, 1e-6) @ fn.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 17, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_on_gpu(T, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    K = 4 * 4096
    x = (torch.randn(T, K, generator=g, device="cuda") * 2).to(dtype)
    fn = torch.randn(24, K, generator=g, device="cuda") * 0.01
    for s in (None, 1, 8):
        part, sq = mix_partials(x, fn, s)
        want_p, want_s = reference(x, fn, part.shape[0])
        torch.testing.assert_close(part, want_p, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(sq, want_s, atol=1e-2, rtol=1e-5)


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from deepinfer.kernels.mhc_mix import _launch, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "fn = torch.randn(24, 256, generator=g)\n"
        "for T, s in ((1, 1), (3, 2), (37, 4)):\n"
        "    x = torch.randn(T, 256, generator=g)\n"
        "    part, sq = _launch(x, fn, s)\n"
        "    want_p, want_s = reference(x, fn, s)\n"
        "    torch.testing.assert_close(part, want_p, atol=1e-4, rtol=1e-5)\n"
        "    torch.testing.assert_close(sq, want_s, atol=1e-4, rtol=1e-5)\n"
        "print('ok')\n")
    run_interpreted(code)
