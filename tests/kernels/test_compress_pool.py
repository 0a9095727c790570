"""Compressor pooling kernel against its torch reference (and the reference against the layer's
CPU path, which it replaces on CUDA)."""
import pytest
import torch

from deepinfer.kernels.compress_pool import compress_pool, reference
from interpreter import run_interpreted


def case(N: int, m: int, dim: int, overlap: bool, T: int = 40, R: int = 12, device: str = "cpu", seed: int = 0):
    """N entries of span 2m (overlap) or m; each slot from this step's T tokens, the R carry rows,
    or absent (the last slot, the entry's own token, is always present)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width, S = (2 * dim if overlap else dim), (2 * m if overlap else m)
    kv, score = torch.randn(T, width, generator=g), torch.randn(T, width, generator=g) * 3
    ckv, cscore = torch.randn(R, width, generator=g), torch.randn(R, width, generator=g) * 3
    kind = torch.randint(0, 3, (N, S), generator=g)
    kind[:, -1] = 0
    new = torch.where(kind == 0, torch.randint(0, T, (N, S), generator=g), -1)
    old = torch.where(kind == 1, torch.randint(0, R, (N, S), generator=g), -1)
    return [t.to(device) for t in (kv, score, ckv, cscore, new, old)]


def test_reference_is_the_layers_pooling():
    from deepinfer.layers.attention import Compressor
    from deepinfer.state.forward_batch import CompressPlan
    from deepinfer.state.kv_state import CarryState
    from deepinfer.layers.rotary import RopeCache

    for overlap in (True, False):
        m, dim = 4, 16
        kv, score, ckv, cscore, new, old = case(5, m, dim, overlap)
        comp = Compressor(8, dim, m, overlap, 1e-6, torch.float32)
        z = torch.zeros(0, dtype=torch.long)
        plan = CompressPlan(m, new, old, z, torch.zeros(5, dtype=torch.long), z, z, z, torch.zeros(1, 1, dtype=torch.long))
        got = {}
        comp._finish = lambda pooled, *a: got.setdefault("pooled", pooled)  # the pooled rows, before norm + rope
        comp.wkv.forward_fp32 = lambda x: kv
        comp.wgate.forward_fp32 = lambda x: score
        with torch.no_grad():
            comp.ape.zero_()
            comp(torch.zeros(kv.shape[0], 8), torch.zeros(kv.shape[0], dtype=torch.long), plan,
                 CarryState(ckv, cscore), RopeCache.at(torch.zeros(5, dtype=torch.long), torch.ones(1)))
        torch.testing.assert_close(got["pooled"], reference(kv, score, ckv, cscore, new, old, dim, overlap))


@pytest.mark.gpu
@pytest.mark.parametrize("N, m, dim, overlap", [(1, 4, 512, True), (37, 4, 128, True), (3, 128, 512, False),
                                                (64, 128, 512, False), (5, 4, 80, True)])
def test_kernel_matches_reference_on_gpu(N, m, dim, overlap):
    args = case(N, m, dim, overlap, device="cuda")
    torch.testing.assert_close(compress_pool(*args, dim, overlap), reference(*args, dim, overlap),
                               atol=1e-5, rtol=1e-5)


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from deepinfer.kernels.compress_pool import _launch, reference\n"
        "from test_compress_pool import case\n"
        "for N, m, dim, overlap in ((1, 4, 32, True), (6, 4, 20, True), (3, 16, 32, False), (2, 8, 48, False)):\n"
        "    args = case(N, m, dim, overlap)\n"
        "    want = reference(*args, dim, overlap)\n"
        "    torch.testing.assert_close(_launch(*args, dim, overlap), want, atol=1e-5, rtol=1e-5)\n"
        "    stacked = torch.cat((args[0], args[1]), 1)\n"  # kv as a column view of a stacked GEMM's output
        "    kv_view = stacked[:, :args[0].shape[1]]\n"
        "    assert torch.equal(_launch(kv_view, *args[1:], dim, overlap), _launch(*args, dim, overlap))\n"
        "print('ok')\n")
    run_interpreted(code)
