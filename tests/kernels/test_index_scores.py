"""Lightning-indexer score kernel against its torch reference, and the reference against the
Indexer's own per-request path."""
import pytest
import torch

from deepinfer.kernels.index_scores import index_scores, reference
from interpreter import SHIMS, run_interpreted


def case(T: int, H: int, Dh: int, E: int, device: str = "cpu", seed: int = 0):
    """bf16-valued inputs; visible counts from 0 (a token that sees nothing) to E."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dh, generator=g).to(torch.bfloat16)
    keys = torch.randn(E, Dh, generator=g).to(torch.bfloat16)
    w = torch.randn(T, H, generator=g)
    visible = torch.randint(0, E + 1, (T,), generator=g)
    visible[0] = 0
    return [t.to(device) for t in (q, keys, w, visible)]


def test_reference_is_the_indexers_arithmetic():
    q, keys, w, visible = case(7, 4, 16, 9)
    logits = (q.float().flatten(0, 1) @ keys.float().t()).view(7, 4, 9).relu()
    want = torch.bmm(w[:, None, :], logits).squeeze(1)
    got = reference(q, keys, w, visible)
    seen = torch.arange(9) < visible[:, None]
    torch.testing.assert_close(got[seen], want[seen], atol=1e-5, rtol=1e-5)
    assert (got[~seen] == float("-inf")).all()
    assert torch.equal(index_scores(q, keys, w, visible), got)  # CPU: the reference


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.index_scores import _launch, reference\n"
        "from test_index_scores import case\n"
        "for T, H, E in [(5, 3, 7), (70, 2, 130)]:\n"
        "    q, keys, w, vis = case(T, H, 16, E)\n"
        "    vis[1:4] = E\n"
        "    got, want = _launch(q, keys, w, vis), reference(q, keys, w, vis)\n"
        "    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)\n"
        "print('ok')\n")
    run_interpreted(code)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,Dh,E", [(1, 64, 128, 64), (2048, 64, 128, 512), (37, 3, 32, 100), (130, 8, 64, 1)])
def test_kernel_matches_reference_on_gpu(T, H, Dh, E):
    q, keys, w, visible = case(T, H, Dh, E, "cuda", seed=T)
    got, want = index_scores(q, keys, w, visible), reference(q, keys, w, visible)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
def test_rows_do_not_depend_on_the_batch_on_gpu():
    """A token's scores are the same bits computed alone, in a block of others, or with more keys."""
    q, keys, w, visible = case(200, 8, 64, 300, "cuda", seed=5)
    full = index_scores(q, keys, w, visible)
    for t in (0, 63, 64, 199):
        alone = index_scores(q[t:t + 1], keys, w[t:t + 1], visible[t:t + 1])
        assert torch.equal(alone, full[t:t + 1])
    few = index_scores(q, keys[:150], w, visible.clamp(max=150))
    assert torch.equal(few, full[:, :150].masked_fill(torch.arange(150, device="cuda") >= visible.clamp(max=150)[:, None],
                                                      float("-inf")))
