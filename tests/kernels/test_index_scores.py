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


def store_case(T: int, H: int, Dh: int, V: int, fmt: str, B: int = 3, R: int = 200, device: str = "cpu",
               seed: int = 0, spread: int = 0):
    """A key store of R rows in `fmt` ("bfloat16" tensors (data,), "mxfp4" (codes, scales)) holding
    V.4.1-style index keys (each 32-column group scaled by 2^[-spread, spread]), queries rounded
    through the same format as the indexer does, an address table [B, V] and visible counts."""
    from deepinfer.formats import group_quant
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(R, Dh, generator=g)
    k = (k.view(R, Dh // 32, 32) * torch.exp2(torch.randint(-spread, spread + 1, (R, Dh // 32, 1), generator=g))).view(R, Dh)
    q = torch.randn(T, H, Dh, generator=g)
    if fmt == "mxfp4":
        store = group_quant.encode(k, fmt)
        q = group_quant.roundtrip(q, fmt)
    else:
        store = (k.to(torch.bfloat16),)
    q = q.to(torch.bfloat16)
    table = torch.stack([torch.randperm(R, generator=g)[:V] for _ in range(B)])
    token_req = torch.randint(0, B, (T,), generator=g)
    w = torch.randn(T, H, generator=g)
    visible = torch.randint(0, V + 1, (T,), generator=g)
    visible[0] = 0
    mv = lambda t: t.to(device)  # noqa: E731
    return mv(q), tuple(mv(t) for t in store), mv(table), mv(token_req), mv(w), mv(visible)


def test_mxfp4_keys_decode_exactly_in_bf16():
    """The kernels decode mxfp4 keys to bf16: e2m1 * 2^k loses nothing there."""
    from deepinfer.formats import group_quant
    _, (codes, scale), *_ = store_case(1, 1, 128, 4, "mxfp4", spread=100)
    exact = group_quant.decode(codes, scale, "mxfp4", torch.float32)
    assert torch.equal(group_quant.decode(codes, scale, "mxfp4", torch.bfloat16).float(), exact)


def test_store_references_read_keys_by_address():
    from deepinfer.kernels.index_scores import read_keys, reference_store, reference_store_per_token
    for fmt in ("bfloat16", "mxfp4"):
        q, store, table, req, w, vis = store_case(6, 4, 64, 20, fmt)
        keys = read_keys(store, fmt, torch.arange(200))
        for t in range(6):
            want = reference(q[t:t + 1], keys[table[req[t]]], w[t:t + 1], vis[t:t + 1])
            got = reference_store(q[t:t + 1], store, fmt, table[req[t]], w[t:t + 1], vis[t:t + 1])
            assert torch.equal(got, want)
            got = reference_store_per_token(q, store, fmt, table, req, w, vis)[t:t + 1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# one-hot queries read single key values back: q_0 = e_j, q_1 = -e_j, w = (1, -1) gives
# relu(k_j) - relu(-k_j) = k_j exactly, so the kernels' in-register decode must equal the reference bit for bit
STORE_CHECK = """
import torch
from deepinfer.kernels import index_scores as K
from test_index_scores import store_case
dev = DEVICE
for fmt in ("bfloat16", "mxfp4"):
    for T, H, Dh, V in ((5, 3, 32, 7), (70, 4, 64, 130)):
        q, store, table, req, w, vis = store_case(T, H, Dh, V, fmt, device=dev, seed=T)
        scale = store[1] if fmt == "mxfp4" else None
        vis[1:4] = V
        for r in range(3):
            got = K._launch(q, store[0], w, vis, scale=scale, rows=table[r], fmt=fmt)
            want = K.reference_store(q, store, fmt, table[r], w, vis)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        got = K._launch_per_token(q, store[0], table, req, w, vis, scale=scale, fmt=fmt)
        want = K.reference_store_per_token(q, store, fmt, table, req, w, vis)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    Dh, V = 64, 40
    _, store, table, req, _, _ = store_case(Dh, 2, Dh, V, fmt, B=1, device=dev, spread=60)
    eye = torch.eye(Dh, device=dev)
    q = torch.stack((eye, -eye), 1).to(torch.bfloat16)
    w = torch.tensor([1.0, -1.0], device=dev).expand(Dh, 2)
    vis = torch.full((Dh,), V, device=dev)
    keys = K.read_keys(store, fmt, table[0])
    got = K._launch(q, store[0], w, vis, scale=store[1] if fmt == "mxfp4" else None, rows=table[0], fmt=fmt)
    assert torch.equal(got, keys.t()), fmt
    got = K._launch_per_token(q, store[0], table, torch.zeros(Dh, dtype=torch.long, device=dev), w, vis,
                              scale=store[1] if fmt == "mxfp4" else None, fmt=fmt)
    assert torch.equal(got, keys.t()), fmt
print('ok')
"""


def test_store_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SHIMS + "DEVICE = 'cpu'\n" + STORE_CHECK)


@pytest.mark.gpu
def test_store_kernels_on_gpu():
    run_interpreted("DEVICE = 'cuda'\n" + STORE_CHECK, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "mxfp4"])
def test_store_kernels_at_flash_width_on_gpu(fmt):
    from deepinfer.kernels.index_scores import (index_scores_store, index_scores_store_per_token, reference_store,
                                                reference_store_per_token)
    q, store, table, req, w, vis = store_case(300, 64, 128, 1000, fmt, R=3000, device="cuda", seed=3)
    torch.testing.assert_close(index_scores_store_per_token(q, store, fmt, table, req, w, vis),
                               reference_store_per_token(q, store, fmt, table, req, w, vis), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(index_scores_store(q, store, fmt, table[1], w, vis),
                               reference_store(q, store, fmt, table[1], w, vis), atol=1e-3, rtol=1e-4)


def test_v4_fp4_index_keys_are_rows_of_the_kernels_mxfp4_layout():
    """V4's FP4 indexer keys (state/kv_state.py IndexKeyStore "fp4": packed int8 pairs + E8M0 per 32) decode to
    the same values as the kernels' mxfp4 rows read from the same bytes, so the V4 indexer's decode path hands
    them to the per-token kernel as they are (layers/attention.py)."""
    from deepinfer.kernels import index_scores as K
    from deepinfer.state.kv_state import IndexKeyStore

    g = torch.Generator().manual_seed(0)
    store = IndexKeyStore(40, 128, "fp4", "cpu")
    store.write(torch.arange(3, 40), (torch.randn(37, 128, generator=g) * 4).to(torch.bfloat16))
    rows = torch.tensor([39, 3, 0, 17, 17, 25])
    want = store.read(rows, torch.float32)
    assert want[1:].abs().sum() > 0
    assert torch.equal(K.read_keys((store.packed.view(torch.uint8), store.scale), "mxfp4", rows), want)
