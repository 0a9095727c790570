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


def per_token_case(T: int, H: int, Dh: int, V: int, B: int = 3, R: int = 200, device: str = "cpu", seed: int = 0):
    """Decode-style inputs: token t belongs to request token_req[t], whose V entries sit at
    table[req] rows of the key store (R rows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dh, generator=g).to(torch.bfloat16)
    keys = torch.randn(R, Dh, generator=g).to(torch.bfloat16)
    table = torch.stack([torch.randperm(R, generator=g)[:V] for _ in range(B)])
    token_req = torch.randint(0, B, (T,), generator=g)
    w = torch.randn(T, H, generator=g)
    visible = torch.randint(0, V + 1, (T,), generator=g)
    visible[0] = 0
    return [t.to(device) for t in (q, keys, table, token_req, w, visible)]


def test_per_token_reference_is_the_shared_reference_per_request():
    from deepinfer.kernels.index_scores import reference_per_token
    q, keys, table, req, w, vis = per_token_case(9, 4, 16, 20)
    got = reference_per_token(q, keys, table, req, w, vis)
    for t in range(9):
        want = reference(q[t:t + 1], keys[table[req[t]]], w[t:t + 1], vis[t:t + 1])
        torch.testing.assert_close(got[t:t + 1], want, atol=1e-5, rtol=1e-5)


def test_per_token_kernel_in_the_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.index_scores import _launch_per_token, reference_per_token\n"
        "from test_index_scores import per_token_case\n"
        "for T, H, V in [(5, 3, 7), (9, 20, 130)]:\n"
        "    args = per_token_case(T, H, 16, V)\n"
        "    got, want = _launch_per_token(*args), reference_per_token(*args)\n"
        "    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)\n"
        "print('ok')\n")


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,Dh,V", [(1, 64, 128, 64), (64, 64, 128, 1024), (37, 3, 32, 100)])
def test_per_token_kernel_on_gpu(T, H, Dh, V):
    from deepinfer.kernels.index_scores import index_scores_per_token, reference_per_token
    args = per_token_case(T, H, Dh, V, R=2 * V, device="cuda", seed=T)
    torch.testing.assert_close(index_scores_per_token(*args), reference_per_token(*args), atol=1e-3, rtol=1e-4)
