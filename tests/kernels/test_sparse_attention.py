from types import SimpleNamespace

import pytest
import torch

from deepinfer.formats import group_quant
from deepinfer.kernels import sparse_attention as sa
from deepinfer.layers.attention import _kernel_format, sparse_attention as layers_sparse_attention
from deepinfer.state.kv_state import EntryStore, FormatStore
from interpreter import SHIMS, interpreted_and_gpu, run_interpreted



V41 = "v41fp8+nvfp4"  # V4.1's reference formats (kv_cache_dtype "auto"): window ring + entries


def make_case(T: int, H: int, D: int, rope: int, W: int, K: int, fmt: str, dtype: torch.dtype,
              device: str = "cpu", seed: int = 0, empty_rows: int = 2, ring_rows: int = 40,
              entry_rows: int = 60, n_req: int = 3, visible: int = 24):
    """Random inputs in both forms: (kernel args tuple, layers args tuple). K = 0: no entries.
    fmt: the kernel's format name for both stores, or "ring format+entries format"; "v41fp8" /
    "nvfp4" are V4.1 FormatStores (rope unused), the others V4 EntryStores.
    Window slots are -1 (absent) with prob ~1/4; the first `empty_rows` tokens have no key at all."""
    ring_fmt, _, ent_fmt = fmt.partition("+")
    ent_fmt = ent_fmt or ring_fmt
    g = torch.Generator().manual_seed(seed)
    Tn = max(T, 1)
    q = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    kv_new = torch.randn(Tn, D, generator=g).to(dtype)
    pick = torch.rand(T, W, generator=g)
    win_new = torch.where(pick < 0.3, torch.randint(0, Tn, (T, W), generator=g), -1)
    win_ring = torch.where(pick >= 0.55, torch.randint(0, ring_rows, (T, W), generator=g), -1)
    win_ring = torch.where(pick < 0.15, torch.randint(0, ring_rows, (T, W), generator=g), win_ring)  # new wins
    win_new[:empty_rows], win_ring[:empty_rows] = -1, -1

    def store(rows, fmt):
        v41 = sa.FORMATS[fmt][1]
        s = FormatStore(rows, D, v41, "cpu") if v41 is not None else EntryStore(rows, D, rope, fmt, "cpu")
        x = torch.randn(rows, D, generator=g) * torch.exp2(torch.randint(-3, 4, (rows, 1), generator=g).float())
        s.write(torch.arange(rows), x)
        return s

    ring = store(ring_rows, ring_fmt)
    token_req = torch.randint(0, n_req, (T,), generator=g)
    entries = entry_ids = plan = None
    entry_addr = None
    if K:
        entries = store(entry_rows, ent_fmt)
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
            for name in ("data", "nope_q", "nope_scale", "rope", "codes", "scale"):
                if hasattr(s, name):
                    setattr(s, name, getattr(s, name).to(device))
    batch = SimpleNamespace(win_new=dev(win_new), win_ring=dev(win_ring), token_req=dev(token_req))
    if plan is not None:
        plan.addr = dev(plan.addr)
    kernel_args = (dev(q), dev(kv_new), dev(win_new), dev(win_ring), tuple(ring.tensors()), ring_fmt,
                   dev(entry_addr), tuple(entries.tensors()) if entries is not None else None, ent_fmt if K else None,
                   dev(sinks), scale)
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


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "fp8", V41, "v41fp8", "nvfp4"])
@pytest.mark.parametrize("T,H,D,rope,W,K", [(1, 2, 32, 8, 4, 0), (9, 3, 64, 16, 6, 5), (17, 4, 32, 8, 8, 12)])
def test_reference_matches_layers_path(fmt, T, H, D, rope, W, K):
    kargs, largs = make_case(T, H, D, rope, W, K, fmt, torch.float32)
    want = layers_sparse_attention(*largs)
    got = sa.reference(*kargs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (got[:2] == 0).all()  # keyless tokens: sink only -> 0
    # the CPU launcher is the reference
    assert torch.equal(sa.sparse_attention(*kargs), got)


@pytest.mark.parametrize("fmt", ["fp8", V41])
def test_reference_matches_layers_path_bf16(fmt):
    kargs, largs = make_case(11, 4, 64, 16, 8, 7, fmt, torch.bfloat16, seed=3)
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
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", V41])
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
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", V41])
def test_kernel_tuning_knobs_on_gpu(block_h, block_n, num_warps, num_stages, fmt):
    kargs, _ = make_case(9, 64, 512, 64, 128, 200, fmt, torch.bfloat16, device="cuda", seed=1,
                         ring_rows=300, entry_rows=700, visible=600)
    got = sa.sparse_attention(*kargs, block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    check_close(got, sa.reference(*kargs), 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", V41])
@pytest.mark.parametrize("T", [1, 64, 1030])
def test_entry_ids_translated_in_the_kernel_on_gpu(fmt, T):
    """indirect=(token_req, table): the kernel reads the same addresses the host gather makes."""
    kargs, largs = make_case(T, 64, 512, 64, 128, 512, fmt, torch.bfloat16, device="cuda", seed=5,
                             ring_rows=300, entry_rows=700, visible=600)
    ids, table, req = largs[4], largs[5].addr, largs[2].token_req
    want = sa.sparse_attention(*kargs)
    assert torch.equal(sa.sparse_attention(*kargs[:6], ids, *kargs[7:], indirect=(req, table)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["float32", "fp8", V41])
def test_fp32_queries_fall_back_to_the_reference_on_gpu(fmt):
    """Compiled launches are bf16-only (see `supported`): fp32 q gives the reference's exact values."""
    kargs, _ = make_case(37, 64, 512, 64, 128, 512, fmt, torch.float32, device="cuda", seed=2, empty_rows=2,
                         ring_rows=300, entry_rows=700, visible=600)
    assert torch.equal(sa.sparse_attention(*kargs), sa.reference(*kargs))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", V41])
def test_layers_path_dispatches_to_kernel_on_gpu(fmt, monkeypatch):
    kargs, largs = make_case(7, 16, 128, 32, 12, 20, fmt, torch.bfloat16, device="cuda", seed=4)
    calls = []
    real = sa._launch
    monkeypatch.setattr(sa, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = layers_sparse_attention(*largs)
    assert calls, "the layers path did not use the kernel"
    check_close(got, sa.reference(*kargs), 2e-2)


INTERPRETER_CASES = {  # fmt, dtype, splits, W, K, D
    "v4": "[('bfloat16', torch.bfloat16, 1, 4, 3, 32), ('fp8', torch.bfloat16, 2, 4, 3, 32),"
          " ('float32', torch.float32, 1, 4, 3, 32), ('fp8', torch.float32, 3, 18, 20, 32),"
          " ('fp8', torch.bfloat16, 1, 4, 0, 32), ('bfloat16', torch.bfloat16, 4, 18, 20, 32)]",
    # V4.1's formats: window only, window + entries, split, fp32 q, both formats in either store, D = 32 (one
    # fp8 scale group a row) and 64
    "v41": f"[('{V41}', torch.bfloat16, 1, 4, 3, 32), ('{V41}', torch.bfloat16, 3, 18, 20, 64),"
           f" ('{V41}', torch.float32, 2, 18, 20, 64), ('v41fp8', torch.bfloat16, 1, 18, 0, 64),"
           " ('v41fp8', torch.float32, 2, 4, 0, 32), ('nvfp4+v41fp8', torch.bfloat16, 2, 4, 20, 32),"
           " ('bfloat16+nvfp4', torch.float32, 1, 4, 3, 32), ('nvfp4', torch.bfloat16, 4, 18, 20, 64)]",
}


@pytest.mark.parametrize("cases", sorted(INTERPRETER_CASES))
def test_kernel_matches_reference_in_the_triton_interpreter(cases):
    pytest.importorskip("triton")
    code = (
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.sparse_attention import _launch, reference\n"
        "from test_sparse_attention import make_case, check_close\n"
        f"for fmt, dtype, splits, W, K, D in {INTERPRETER_CASES[cases]}:\n"
        "    kargs, largs = make_case(5, 4, D, 8, W, K, fmt, dtype, entry_rows=8, ring_rows=6, visible=6)\n"
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
                        " ('bfloat16', torch.bfloat16, 4, 0, 1), ('float32', torch.float32, 4, 40, 1),"
                        f" ('{V41}', torch.bfloat16, 18, 40, 1), ('{V41}', torch.float32, 4, 20, 2),"
                        " ('v41fp8', torch.float32, 18, 0, 1)]\n"
                        "H, D, BN, DEV = 4, 32, 16, 'cpu'\n",
                        "import torch\nbf = torch.bfloat16\nCASES = [('bfloat16', bf, 128, 512, 4), ('fp8', bf, 128, 512, 4),"
                        " ('bfloat16', bf, 128, 40, 4), ('bfloat16', bf, 128, 0, 4), ('fp8', bf, 128, 2048, 2),"
                        f" ('{V41}', bf, 128, 512, 4), ('{V41}', bf, 128, 2048, 2), ('v41fp8', bf, 128, 0, 4)]\n"
                        "H, D, BN, DEV = 64, 512, 32, 'cuda'\n")


def _every_code_store(fmt: str, rows: int, D: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A V4.1 store (codes, scale) whose rows hold every code of the format (e4m3 NaNs aside) under
    scales of the range V4.1's encoders write: fp8 E8M0 bytes 105..160 (>= 2^-22), nvfp4 every positive
    finite e4m3 (subnormals included)."""
    g = torch.Generator().manual_seed(7)
    n = torch.arange(rows * D)
    if fmt == "v41fp8":
        codes = torch.where((n % 256) % 128 == 127, 0, n % 256).to(torch.uint8).view(torch.float8_e4m3fn)
        scale = torch.randint(105, 161, (rows, D // 32), generator=g).to(torch.uint8)
        return codes.view(rows, D).to(device), scale.to(device)
    codes = (n[: rows * D // 2] * 37 % 256).to(torch.uint8).view(rows, D // 2)      # every byte: both nibbles
    scale = (torch.arange(rows * D // 16) % 126 + 1).to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.to(device), scale.view(rows, D // 16).to(device)


def test_v41_decoded_keys_are_exact_in_bf16():
    """The kernel's invariant for bf16 q: V4.1's decoded keys (fp32 products) are bf16 values."""
    for fmt in ("v41fp8", "nvfp4"):
        codes, scale = _every_code_store(fmt, 64, 512)
        want = group_quant.decode(codes, scale, sa.FORMATS[fmt][1], torch.float32)
        assert torch.isfinite(want).all()
        assert torch.equal(want.to(torch.bfloat16).float(), want), fmt


# One valid key per token, zero queries and a -1e4 sink: softmax weight 1, so the output is the decoded
# key itself, bit for bit (bf16 and fp32 q), for every code of V4.1's formats, in the window and as an entry
EXACT_DECODE_CHECK = (
    "import torch\n"
    "from deepinfer.formats import group_quant\n"
    "from deepinfer.kernels.sparse_attention import _launch, FORMATS\n"
    "from test_sparse_attention import _every_code_store\n"
    "R, H, W, K = 16, 4, 5, 3\n"
    "only = torch.full((R, W), -1, device=DEV)\n"
    "only[:, 2] = torch.arange(R)\n"
    "none = torch.full((R, W), -1, device=DEV)\n"
    "for fmt in ('v41fp8', 'nvfp4'):\n"
    "    store = _every_code_store(fmt, R, D, DEV)\n"
    "    keys = group_quant.decode(*store, FORMATS[fmt][1], torch.float32)\n"
    "    for dtype in DTYPES:\n"
    "        q, sinks = torch.zeros(R, H, D, dtype=dtype, device=DEV), torch.full((H,), -1e4, device=DEV)\n"
    "        want = keys.to(dtype)[:, None].expand(R, H, D)\n"
    "        win = _launch(q, q[:, 0], none, only, store, fmt, None, None, None, sinks, 1.0, block_h=16, block_n=16)\n"
    "        ent = _launch(q, q[:, 0], none, none, store, fmt, only[:, 1:1 + K].flip(1), store, fmt, sinks, 1.0,\n"
    "                      block_h=16, block_n=16, num_splits=2)\n"
    "        assert torch.equal(win, want), (fmt, dtype)\n"
    "        assert torch.equal(ent, want), (fmt, dtype)\n"
    "print('ok')\n")
test_v41_keys_decode_exactly_in_the_triton_interpreter, test_v41_keys_decode_exactly_on_gpu = \
    interpreted_and_gpu(EXACT_DECODE_CHECK,
                        "import torch\nDTYPES, D, DEV = (torch.bfloat16, torch.float32), 64, 'cpu'\n",
                        "import torch\nDTYPES, D, DEV = (torch.bfloat16,), 512, 'cuda'\n")


@pytest.mark.parametrize("fmt", ["bfloat16", "float32", "fp8", "nvfp4", "mxfp4"])
def test_layers_path_names_v41_stores_for_the_kernel(fmt):
    """V4.1's FormatStores map to the kernel's formats (fp8 -> v41fp8, nvfp4 -> nvfp4), which the
    kernel takes at V4.1's widths; V4's EntryStore keeps its own names. CPU: only the mapping is checked."""
    want = {"bfloat16": "bfloat16", "fp8": "v41fp8", "nvfp4": "nvfp4"}.get(fmt)
    assert _kernel_format(FormatStore(4, 64, fmt, "meta")) == want
    if want is not None:
        for D in (64, 128, 512):  # head_dim of the tiny and demo V4.1 models, of V4.1-Flash
            q = torch.empty(3, 8, D, dtype=torch.bfloat16, device="meta")
            assert sa.supported(q, q[:, 0], want, want, True)
    if fmt in ("bfloat16", "float32", "fp8"):
        assert _kernel_format(EntryStore(4, 64, 16, fmt, "meta")) == (None if fmt == "float32" else fmt)
    assert _kernel_format(None) is None


@pytest.mark.parametrize("fmt", ["fp8", V41, "nvfp4+v41fp8", "bfloat16+fp8"])
def test_stores_decoded_once_give_the_same_attention(fmt):
    """A prefill-shaped step (many tokens per ring row and entry): `decoded_once` hands the kernel bf16
    copies of the quantised stores, and attention over them equals attention over the stores, bit for bit."""
    from deepinfer.layers.attention import decoded_once

    kargs, largs = make_case(64, 4, 64, 16, 8, 12, fmt, torch.bfloat16, seed=7, ring_rows=40, entry_rows=60,
                             visible=24)
    q, kv_new, batch, ring, ids, plan, entries, sinks, scale = largs
    ring_fmt, ent_fmt = _kernel_format(ring), _kernel_format(entries)
    (ring_t, ring_fmt2), (ent_t, ent_fmt2, table) = decoded_once(ring, ring_fmt, batch.win_new.numel(), entries,
                                                                  ent_fmt, ids.numel(), plan.addr)
    assert ring_fmt2 == "bfloat16" and ent_fmt2 == "bfloat16"  # 64 x 8 reads >= 4 x 40 rows; 64 x 12 >= 4 x 72
    assert ring_t[0].dtype == ent_t[0].dtype == torch.bfloat16 and ent_t[0].shape[0] == plan.addr.numel()
    assert torch.equal(table.flatten(), torch.arange(plan.addr.numel()))
    copied = sa.reference(q, kv_new, batch.win_new, batch.win_ring, ring_t, ring_fmt2,
                          sa.entry_addresses(ids, batch.token_req, table), ent_t, ent_fmt2, sinks, scale)
    assert torch.equal(copied, sa.reference(*kargs))


def test_decode_shaped_steps_keep_the_stores():
    """Few reads per row (decode: one token per request over long histories): nothing is copied; a -1
    address stays -1 in the copy's table."""
    from deepinfer.layers.attention import decoded_once

    _, largs = make_case(4, 4, 64, 16, 8, 12, "fp8", torch.bfloat16, seed=8, ring_rows=40, entry_rows=60, visible=24)
    _, _, batch, ring, ids, plan, entries, _, _ = largs
    (ring_t, ring_fmt), (ent_t, ent_fmt, table) = decoded_once(ring, "fp8", batch.win_new.numel(), entries, "fp8",
                                                                ids.numel(), plan.addr)
    assert (ring_fmt, ent_fmt) == ("fp8", "fp8") and table is plan.addr
    assert all(a is b for a, b in zip(ring_t + ent_t, ring.tensors() + entries.tensors()))
    addr = plan.addr.clone()
    addr[0, -3:] = -1
    _, (_, _, table) = decoded_once(ring, "fp8", 0, entries, "fp8", 10 ** 6, addr)
    assert (table[0, -3:] == -1).all() and (table[addr >= 0] >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", V41])
def test_layers_path_with_stores_decoded_once_on_gpu(fmt):
    """The layers path at a prefill shape (stores copied to bf16, the bf16 tiles) against the reference."""
    T = 1030
    kargs, largs = make_case(T, 64, 512, 64, 128, 512, fmt, torch.bfloat16, device="cuda", seed=9,
                             ring_rows=300, entry_rows=700, n_req=2, visible=256)
    check_close(layers_sparse_attention(*largs), sa.reference(*kargs), 2e-2)
