from types import SimpleNamespace

import pytest
import torch

from deepinfer.kernels import sparse_attention as sa
from deepinfer.layers.attention import sparse_attention as layers_sparse_attention
from deepinfer.state.kv_state import EntryStore
from interpreter import SHIMS, interpreted_and_gpu, run_interpreted



def make_case(T: int, H: int, D: int, rope: int, W: int, K: int, fmt: str, dtype: torch.dtype,
              device: str = "cpu", seed: int = 0, empty_rows: int = 2, ring_rows: int = 40,
              entry_rows: int = 60, n_req: int = 3, visible: int = 24):
    """Random inputs in both forms: (kernel args tuple, layers args tuple). K = 0: no entries.
    Window slots are -1 (absent) with prob ~1/4; the first `empty_rows` tokens have no key at all."""
    g = torch.Generator().manual_seed(seed)
    Tn = max(T, 1)
    q = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    kv_new = torch.randn(Tn, D, generator=g).to(dtype)
    pick = torch.rand(T, W, generator=g)
    win_new = torch.where(pick < 0.3, torch.randint(0, Tn, (T, W), generator=g), -1)
    win_ring = torch.where(pick >= 0.55, torch.randint(0, ring_rows, (T, W), generator=g), -1)
    win_ring = torch.where(pick < 0.15, torch.randint(0, ring_rows, (T, W), generator=g), win_ring)  # new wins
    win_new[:empty_rows], win_ring[:empty_rows] = -1, -1

    def store(rows):
        s = EntryStore(rows, D, rope, fmt, "cpu")
        x = torch.randn(rows, D, generator=g) * torch.exp2(torch.randint(-3, 4, (rows, 1), generator=g).float())
        s.write(torch.arange(rows), x)
        return s

    ring = store(ring_rows)
    token_req = torch.randint(0, n_req, (T,), generator=g)
    entries = entry_ids = plan = None
    entry_addr = None
    if K:
        entries = store(entry_rows)
        plan = SimpleNamespace(addr=torch.stack([torch.randperm(entry_rows, generator=g)[:visible]
                                                 for _ in range(n_req)]))
        entry_ids = torch.where(torch.rand(T, K, generator=g) < 0.8, torch.randint(0, visible, (T, K), generator=g), -1)
        entry_ids[:empty_rows] = -1
        entry_addr = torch.where(entry_ids >= 0, plan.addr[token_req[:, None], entry_ids.clamp(min=0)], -1)
    sinks = torch.randn(H, generator=g)
    scale = D ** -0.5

    def dev(t):
        return None if t is None else t.to(device)

    for s in (ring, entries):
        if s is not None:
            for name in ("data", "nope_q", "nope_scale", "rope"):
                if hasattr(s, name):
                    setattr(s, name, getattr(s, name).to(device))
    batch = SimpleNamespace(win_new=dev(win_new), win_ring=dev(win_ring), token_req=dev(token_req))
    if plan is not None:
        plan.addr = dev(plan.addr)
    kernel_args = (dev(q), dev(kv_new), dev(win_new), dev(win_ring), tuple(ring.tensors()), fmt, dev(entry_addr),
                   tuple(entries.tensors()) if entries is not None else None, fmt if K else None, dev(sinks), scale)
    layers_args = (dev(q), dev(kv_new), batch, ring, dev(entry_ids), plan, entries, dev(sinks), scale)
    return kernel_args, layers_args


def check_close(got: torch.Tensor, want: torch.Tensor, tol: float):
    """bf16 P and output rounding: max |got - want| <= tol * max |want|, mean error <= tol / 4 * mean |want|."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).abs()
    ref = want.float().abs()
    assert err.max() <= tol * max(ref.max().item(), 1e-3), f"max err {err.max():.3g} vs value scale {ref.max():.3g}"
    assert err.mean() <= tol / 4 * max(ref.mean().item(), 1e-3), f"mean err {err.mean():.3g} vs {ref.mean():.3g}"


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("T,H,D,rope,W,K", [(1, 2, 32, 8, 4, 0), (9, 3, 64, 16, 6, 5), (17, 4, 32, 8, 8, 12)])
def test_reference_matches_layers_path(fmt, T, H, D, rope, W, K):
    kargs, largs = make_case(T, H, D, rope, W, K, fmt, torch.float32)
    want = layers_sparse_attention(*largs)
    got = sa.reference(*kargs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (got[:2] == 0).all()  # keyless tokens: sink only -> 0
    # the CPU launcher is the reference
    assert torch.equal(sa.sparse_attention(*kargs), got)


def test_reference_matches_layers_path_bf16():
    kargs, largs = make_case(11, 4, 64, 16, 8, 7, "fp8", torch.bfloat16, seed=3)
    torch.testing.assert_close(sa.reference(*kargs), layers_sparse_attention(*largs), atol=0, rtol=0)


GPU_SHAPES = [  # T, H, D, rope, W, K
    (1, 64, 512, 64, 128, 512),
    (37, 64, 512, 64, 128, 512),
    (37, 64, 512, 64, 128, 0),
    (5, 64, 512, 64, 128, 100),
    (1030, 64, 512, 64, 128, 40),  # prefill-sized: the 64-head tiles
    (37, 3, 64, 16, 20, 33),
    (300, 8, 128, 32, 16, 40),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_kernel_matches_reference_on_gpu(fmt, shape, num_splits):
    T, H, D, rope, W, K = shape
    empty = min(2, T - 1)
    kargs, _ = make_case(T, H, D, rope, W, K, fmt, torch.bfloat16, device="cuda", seed=T + H, empty_rows=empty,
                         ring_rows=300, entry_rows=700, visible=600)
    got = sa.sparse_attention(*kargs, num_splits=num_splits)
    want = sa.reference(*kargs)
    check_close(got, want, 2e-2)
    assert (got[:empty] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("block_h,block_n,num_warps,num_stages", [(16, 32, 8, 1), (16, 16, 4, 2), (32, 32, 8, 1),
                                                                  (64, 32, 8, 1), (16, 64, 8, 1), (16, 32, 8, 3),
                                                                  (64, 32, 8, 2)])
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
def test_kernel_tuning_knobs_on_gpu(block_h, block_n, num_warps, num_stages, fmt):
    kargs, _ = make_case(9, 64, 512, 64, 128, 200, fmt, torch.bfloat16, device="cuda", seed=1,
                         ring_rows=300, entry_rows=700, visible=600)
    got = sa.sparse_attention(*kargs, block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    check_close(got, sa.reference(*kargs), 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
@pytest.mark.parametrize("T", [1, 64, 1030])
def test_entry_ids_translated_in_the_kernel_on_gpu(fmt, T):
    """indirect=(token_req, table): the kernel reads the same addresses the host gather makes."""
    kargs, largs = make_case(T, 64, 512, 64, 128, 512, fmt, torch.bfloat16, device="cuda", seed=5,
                             ring_rows=300, entry_rows=700, visible=600)
    ids, table, req = largs[4], largs[5].addr, largs[2].token_req
    want = sa.sparse_attention(*kargs)
    assert torch.equal(sa.sparse_attention(*kargs[:6], ids, *kargs[7:], indirect=(req, table)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["float32", "fp8"])
def test_fp32_queries_fall_back_to_the_reference_on_gpu(fmt):
    """Compiled launches are bf16-only (see `supported`): fp32 q gives the reference's exact values."""
    kargs, _ = make_case(37, 64, 512, 64, 128, 512, fmt, torch.float32, device="cuda", seed=2, empty_rows=2,
                         ring_rows=300, entry_rows=700, visible=600)
    assert torch.equal(sa.sparse_attention(*kargs), sa.reference(*kargs))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
def test_layers_path_dispatches_to_kernel_on_gpu(fmt, monkeypatch):
    kargs, largs = make_case(7, 16, 128, 32, 12, 20, fmt, torch.bfloat16, device="cuda", seed=4)
    calls = []
    real = sa._launch
    monkeypatch.setattr(sa, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = layers_sparse_attention(*largs)
    assert calls, "the layers path did not use the kernel"
    check_close(got, sa.reference(*kargs), 2e-2)


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.sparse_attention import _launch, reference\n"
        "from test_sparse_attention import make_case, check_close\n"
        "for fmt, dtype, splits, W, K in [('bfloat16', torch.bfloat16, 1, 4, 3), ('fp8', torch.bfloat16, 2, 4, 3),\n"
        "                                 ('float32', torch.float32, 1, 4, 3), ('fp8', torch.float32, 3, 18, 20),\n"
        "                                 ('fp8', torch.bfloat16, 1, 4, 0), ('bfloat16', torch.bfloat16, 4, 18, 20)]:\n"
        "    kargs, largs = make_case(5, 4, 32, 8, W, K, fmt, dtype, entry_rows=8, ring_rows=6, visible=6)\n"
        "    if K > 16:  # a top-k list's trailing -1s: the second entry tile is keyless for tokens 2..4\n"
        "        kargs[6][2:, 16:] = -1\n"
        "        largs[4][2:, 16:] = -1\n"
        "    got = _launch(*kargs, block_h=16, block_n=16, num_splits=splits)\n"
        "    if K:  # entry ids translated in the kernel: the same addresses, the same bits\n"
        "        ids, table, req = largs[4], largs[5].addr, largs[2].token_req\n"
        "        assert torch.equal(_launch(*kargs[:6], ids, *kargs[7:], block_h=16, block_n=16, num_splits=splits,\n"
        "                                   indirect=(req, table)), got)\n"
        "    want = reference(*kargs)\n"
        "    if dtype == torch.float32:\n"
        "        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)\n"
        "    else:\n"
        "        check_close(got, want, 2e-2)\n"
        "    assert (got[:2] == 0).all(), fmt\n"
        "print('ok')\n")
    run_interpreted(code)


FIXED_SPLIT_CHECK = (
    "import torch\n"
    "from deepinfer.kernels.sparse_attention import _launch, reference\n"
    "from test_sparse_attention import make_case, check_close\n"
    "def pad(kargs, extra):\n"  # the same keys with `extra` more -1 entry columns (a wider batch)
    "    a = list(kargs)\n"
    "    if a[6] is None:\n"
    "        return kargs\n"
    "    a[6] = torch.cat((a[6], torch.full((a[6].shape[0], extra), -1, dtype=a[6].dtype, device=a[6].device)), 1)\n"
    "    return tuple(a)\n"
    "for fmt, dtype, W, K, tps in CASES:\n"
    "    kargs, _ = make_case(5, H, D, 8, W, K, fmt, dtype, device=DEV, entry_rows=80, ring_rows=60,\n"
    "                         visible=70)\n"
    "    runs = [_launch(*args, block_h=16, block_n=BN, tiles_per_split=tps, split_programs=progs)\n"
    "            for args in (kargs, pad(kargs, 3 * BN)) for progs in (True, False)]\n"
    "    for r in runs[1:]:\n"
    "        assert torch.equal(r, runs[0]), (fmt, W, K, tps)\n"
    "    check_close(runs[0].to(torch.bfloat16), reference(*kargs).to(torch.bfloat16), 2e-2)\n"
    "    assert (runs[0][:2] == 0).all()\n"
    "print('ok')\n")


# Split programs + in-order merge == one program folding the splits in registers, and a wider
# (padded) entry list changes no bit (fp32 catches any rounding difference; bf16 and fp8 stores too)
test_fixed_splits_are_invariant_in_the_triton_interpreter, test_fixed_splits_are_invariant_on_gpu = \
    interpreted_and_gpu(FIXED_SPLIT_CHECK,
                        "import torch\nCASES = [('bfloat16', torch.bfloat16, 4, 40, 1), ('fp8', torch.bfloat16, 18, 20, 2),"
                        " ('bfloat16', torch.bfloat16, 4, 0, 1), ('float32', torch.float32, 4, 40, 1)]\n"
                        "H, D, BN, DEV = 4, 32, 16, 'cpu'\n",
                        "import torch\nbf = torch.bfloat16\nCASES = [('bfloat16', bf, 128, 512, 4), ('fp8', bf, 128, 512, 4),"
                        " ('bfloat16', bf, 128, 40, 4), ('bfloat16', bf, 128, 0, 4), ('fp8', bf, 128, 2048, 2)]\n"
                        "H, D, BN, DEV = 64, 512, 32, 'cuda'\n")
