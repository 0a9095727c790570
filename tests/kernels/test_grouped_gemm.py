import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.grouped_gemm import grouped_gemm, max_m_tiles, reference
from deepinfer.layers.linear import DENSE, Linear, QuantSpec, dequant_expert
from deepinfer.layers.moe import Experts
from interpreter import SHIMS, interpreted_and_gpu, run_interpreted

QUANT = {"bf16": DENSE, "fp8": QuantSpec(block_size=(128, 128)),
         "fp4": QuantSpec(block_size=(128, 128), fp4_experts=True)}


def make_case(counts, N, K, fmt, block=(128, 128), scale_dtype="e8m0", device="cpu", seed=0, exps=(120, 125)):
    """Rows sorted by group (counts[e] rows each) and random weights in the storage format: every
    e4m3 / e2m1 code is reachable and the E8M0 scales vary per block (2^(exps[0]-127) .. 2^(exps[1]-128))."""
    g = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    if fmt == "bf16":
        w, s = (torch.randn(E, N, K, generator=g) * 0.05).to(torch.bfloat16), None
    elif fmt == "fp8":
        w = (torch.randn(E, N, K, generator=g) * 4).to(torch.float8_e4m3fn)
        shape = (E, -(-N // block[0]), -(-K // block[1]))
        s = torch.randint(*exps, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        if scale_dtype == "fp32":
            s = torch.rand(shape, generator=g) * 0.03 + 0.002
    else:
        w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
        s = torch.randint(*exps, (E, N, K // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(a), move(w), move(offs), move(s)


def _loop(a, w, offs, s, quant):
    """The Experts reference loop's arithmetic: dequant_expert + F.linear per group."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype)
    bounds = [0] + offs.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            we = dequant_expert(w[e], None if s is None else s[e], quant, torch.float32)
            out[lo:hi] = F.linear(a[lo:hi].float(), we).to(a.dtype)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("counts", [[0, 1, 30, 0, 3], [17]])
def test_reference_matches_the_dequant_expert_loop(fmt, counts):
    a, w, offs, s = make_case(counts, 80, 256, fmt)
    got = reference(a, w, offs, s, (128, 128))
    torch.testing.assert_close(got.float(), _loop(a, w, offs, s, QUANT[fmt]).float(), atol=2e-2, rtol=1e-2)
    if fmt == "fp8":  # odd blocks dequantise the same way
        a, w, offs, s = make_case(counts, 80, 96, fmt, block=(16, 48))
        torch.testing.assert_close(reference(a, w, offs, s, (16, 48)).float(),
                                   _loop(a, w, offs, s, QuantSpec(block_size=(16, 48))).float(), atol=2e-2, rtol=1e-2)


def test_one_group_forms_in_the_triton_interpreter():
    """A dense linear's two forms, a 2-D weight without offs and one group with offs: both give the
    Experts reference loop's rows. Several groups need offs; a 2-D weight takes one offset."""
    pytest.importorskip("triton")
    run_interpreted(
        SHIMS +
        "import pytest, torch\n"
        "from deepinfer.kernels.grouped_gemm import _launch\n"
        "from test_grouped_gemm import QUANT, _loop, make_case\n"
        "cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1)\n"
        "for fmt in ('bf16', 'fp8', 'fp4'):\n"
        "    a, w, offs, s = make_case([21], 40, 96, fmt)\n"
        "    want = _loop(a, w, offs, s, QUANT[fmt])\n"
        "    s0, s2 = (None, None) if s is None else (s[0], s.expand(2, -1, -1))\n"
        "    for got in (_launch(a, w[0], None, s0, (128, 128), **cfg), _launch(a, w, offs, s, (128, 128), **cfg)):\n"
        "        assert got.shape == (21, 40) and got.dtype == torch.bfloat16, fmt\n"
        "        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)\n"
        "    with pytest.raises(ValueError, match='offs is required'):\n"
        "        _launch(a, w.expand(2, -1, -1), None, s2, (128, 128), **cfg)\n"
        "    with pytest.raises(ValueError, match='one group'):\n"
        "        _launch(a, w[0], offs.repeat(2), s0, (128, 128), **cfg)\n"
        "print('ok')\n")


def test_tile_bound_holds_for_any_split():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        E = int(torch.randint(1, 40, (1,), generator=g))
        M = int(torch.randint(0, 400, (1,), generator=g))
        bm = [16, 32, 64, 128][int(torch.randint(0, 4, (1,), generator=g))]
        cuts = torch.sort(torch.randint(0, M + 1, (E - 1,), generator=g)).values.tolist()
        counts = [b - a for a, b in zip([0] + cuts, cuts + [M])]
        assert sum(-(-c // bm) for c in counts) <= max_m_tiles(M, E, bm)


# ---------------------------------------------------------------- GPU: kernel vs reference

SHAPES = [  # (counts per expert, N, K)
    ([0, 1, 300, 0, 2, 37], 80, 96),          # empty experts, one row, many rows; N, K ragged
    ([1, 0, 3, 2, 0, 0, 1, 1], 2048, 4096),   # decode-like at the real size
    ([300, 5, 0, 129], 2048, 4096),           # prefill-like at the real size
    ([0, 0, 0], 64, 128),                     # no rows at all in the groups
]
CONFIGS = [  # None: default_config's pick
    None,
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=2),  # fp8: scale per element
]


def _check(got, want):
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
def test_kernel_matches_reference_on_gpu(fmt, shape, cfg):
    counts, N, K = SHAPES[shape]
    a, w, offs, s = make_case(counts, N, K, fmt, device="cuda")
    if sum(counts) == 0:
        assert grouped_gemm(a, w, offs, s, **(CONFIGS[cfg] or {})).shape == (0, N)  # M = 0: no launch
        a = torch.zeros(5, K, dtype=torch.bfloat16, device="cuda")  # rows past offs[-1] stay unwritten
        assert grouped_gemm(a, w, offs, s, **(CONFIGS[cfg] or {})).shape == (5, N)
        torch.cuda.synchronize()
        return
    _check(grouped_gemm(a, w, offs, s, **(CONFIGS[cfg] or {})), reference(a, w, offs, s))


@pytest.mark.gpu
@pytest.mark.parametrize("block,scale_dtype", [((128, 128), "fp32"), ((64, 96), "e8m0"), ((16, 48), "fp32"),
                                              ((1, 32), "e8m0"), ((1, 128), "e8m0")])
@pytest.mark.parametrize("cfg", [1, 2, 4])
def test_fp8_other_blocks_and_fp32_scales_on_gpu(block, scale_dtype, cfg):
    a, w, offs, s = make_case([3, 0, 150, 1], 200, 480, "fp8", block=block, scale_dtype=scale_dtype, device="cuda")
    _check(grouped_gemm(a, w, offs, s, block, **CONFIGS[cfg]), reference(a, w, offs, s, block))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("M,N,K", [(1, 2048, 4096), (1, 4096, 8192), (3, 80, 96), (700, 1536, 512)])
def test_one_group_dense_linear_on_gpu(fmt, M, N, K):
    a, w, offs, s = make_case([M], N, K, fmt, device="cuda")
    want = reference(a, w, offs, s)
    _check(grouped_gemm(a, w[0], None, None if s is None else s[0]), want)  # 2-D weight, offs None
    _check(grouped_gemm(a, w, offs, s), want)                              # E = 1 with offs


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_kernel_replays_in_a_cuda_graph_with_new_offsets(fmt):
    a, w, offs, s = make_case([2, 0, 5, 1], 256, 512, fmt, device="cuda")
    grouped_gemm(a, w, offs, s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm(a, w, offs, s)
    for counts in ([8, 0, 0, 0], [0, 0, 0, 8], [1, 2, 3, 2]):
        offs.copy_(torch.tensor(counts, device="cuda").cumsum(0))
        a.normal_()
        graph.replay()
        _check(out, reference(a, w, offs, s))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantised_experts_take_the_kernel_on_gpu(fmt):
    torch.manual_seed(0)
    quant = QUANT[fmt]
    dim, inter, E = 256, 128, 16
    ex = Experts(dim, inter, E, limit=10.0, dtype=torch.bfloat16, quant=quant)
    for name, (o, i) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
        w, s = make_case([1] * E, o, i, fmt, seed=len(name) + o, exps=(117, 122))[1::2]
        getattr(ex, name).copy_(w)
        getattr(ex, f"{name}_scale").copy_(s)
    x = torch.randn(37, dim, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:4] for _ in range(37)])
    weights = torch.rand(37, 4)
    ref = ex(x.float(), weights, idx)  # the CPU reference loop (fp32 activations)
    ex.cuda()
    assert ex._use_grouped(x.cuda())
    fast = ex(x.cuda(), weights.cuda(), idx.cuda())
    torch.testing.assert_close(fast.cpu(), ref, atol=5e-2, rtol=3e-2)


@pytest.mark.gpu
def test_fp8_linear_takes_the_kernel_on_gpu():
    torch.manual_seed(0)
    lin = Linear(384, 200, torch.bfloat16, QuantSpec(block_size=(128, 128)))
    w, s = make_case([1], 200, 384, "fp8", exps=(117, 122))[1::2]
    lin.weight.copy_(w[0])
    lin.scale.copy_(s[0])
    x = torch.randn(2, 5, 384, dtype=torch.bfloat16)
    ref = F.linear(x.float(), lin.dense_weight(torch.float32))
    lin.cuda()
    fast = lin(x.cuda())
    assert fast.shape == (2, 5, 200) and fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float().cpu(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64, 600])   # 600: past GROUPED_GEMM_ROWS, the dense-weight path
def test_fp8_grouped_projection_on_gpu(T):
    """V4's wo_a: 4 groups of 256 inputs -> 128 outputs each, FP8 weight with 128-blocks."""
    torch.manual_seed(0)
    lin = Linear(256, 4 * 128, torch.bfloat16, QuantSpec(block_size=(128, 128)))
    w, s = make_case([1], 4 * 128, 256, "fp8", exps=(117, 122))[1::2]
    lin.weight.copy_(w[0])
    lin.scale.copy_(s[0])
    x = torch.randn(T, 4, 256, dtype=torch.bfloat16)
    wd = lin.dense_weight(torch.float32).view(4, 128, 256)
    ref = torch.einsum("tgi,goi->tgo", x.float(), wd).flatten(1)
    lin.cuda()
    fast = lin.forward_grouped(x.cuda())
    assert fast.shape == (T, 4 * 128) and fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float().cpu(), ref, atol=3e-2, rtol=2e-2)


def test_split_k_choice():
    from deepinfer.kernels.grouped_gemm import default_config, split_k_for
    dec = default_config(1, 1, 1)  # FP8 decode tiles: 16 x 64 x 128
    assert split_k_for(1, 1024, 4096, dec, 132) == 8        # 16 output tiles: split to 128 programs
    assert split_k_for(1, 32768, 1024, dec, 132) == 1       # 512 tiles keep every SM busy
    assert split_k_for(1, 1024, 4096, default_config(64, 1, 1), 132) == 16  # 64 rows: one 64-row tile
    assert split_k_for(6, 2048, 4096, dec, 132) == 2        # 6 experts x 32 tiles: 192 -> 384 programs
    assert split_k_for(2, 2048, 4096, dec, 132) == 8        # 2 row tiles (e.g. 2 experts): 64 -> 512
    assert split_k_for(9, 2048, 4096, dec, 132) == 1        # 288 programs: >= 2 per SM already
    assert split_k_for(1, 1024, 4096 + 64, dec, 132) == 1   # K not a whole number of tiles


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_split_k_one_group_on_gpu(M, fmt):
    a, w, offs, s = make_case([M], 1024, 4096, fmt, (128, 128), "e8m0", device="cuda")
    want = reference(a, w, offs, s)
    got = grouped_gemm(a, w[0], None, None if s is None else s[0])  # the default: split over K
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    a, w, offs, s = make_case([0, M, 0, 1], 1024, 4096, fmt, (128, 128), "e8m0", device="cuda")
    torch.testing.assert_close(grouped_gemm(a, w, offs, s).float(), reference(a, w, offs, s).float(),
                               atol=3e-2, rtol=2e-2)  # several groups, few rows: split too


# ---------------------------------------------------------------- Triton interpreter (CPU)

def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        SHIMS +  # split-K loops have runtime bounds
        "import torch\n"
        "from deepinfer.kernels.grouped_gemm import _launch, reference\n"
        "from test_grouped_gemm import make_case\n"
        "tile = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1)\n"
        "cases = [('bf16', [0, 1, 37, 0, 5], 40, 80, (128, 128), 'e8m0', tile),\n"
        "         ('fp8', [0, 1, 37, 0, 5], 40, 80, (128, 128), 'e8m0', tile),\n"  # scale on the product
        "         ('fp8', [2, 0, 19], 40, 96, (16, 48), 'fp32', tile),\n"          # scale per element
        "         ('fp4', [0, 1, 37, 0, 5], 40, 96, (128, 128), 'e8m0', tile),\n"
        "         ('fp4', [3, 20], 24, 96, (128, 128), 'e8m0', dict(tile, BLOCK_K=64)),\n"  # ragged K tile
        "         ('bf16', [21], 24, 80, (128, 128), 'e8m0', tile),\n"
        "         ('fp8', [21], 24, 80, (16, 32), 'e8m0', tile),\n"
        "         ('fp8', [0, 7, 30], 40, 128, (1, 32), 'e8m0', dict(tile, BLOCK_K=64))]\n"  # repacked FP4
        "for fmt, counts, N, K, block, sd, cfg in cases:\n"
        "    a, w, offs, s = make_case(counts, N, K, fmt, block, sd)\n"
        "    want = reference(a, w, offs, s, block)\n"
        "    got = [_launch(a, w, offs, s, block, **cfg)]\n"
        "    if len(counts) == 1:\n"  # one group: 2-D weight, no offs
        "        got.append(_launch(a, w[0], None, None if s is None else s[0], block, **cfg))\n"
        "    for g in got:\n"
        "        torch.testing.assert_close(g.float(), want.float(), atol=2e-2, rtol=1.6e-2)\n"
        "for fmt, K, block, sd, split in [('bf16', 128, (128, 128), 'e8m0', 4), ('fp8', 128, (16, 32), 'e8m0', 2),\n"
        "                                 ('fp8', 128, (32, 32), 'fp32', 4), ('fp4', 256, (128, 128), 'e8m0', 2)]:\n"
        "    a, w, offs, s = make_case([13], 24, K, fmt, block, sd)\n"  # split-K over one group
        "    want = reference(a, w, offs, s, block)\n"
        "    g = _launch(a, w[0], None, None if s is None else s[0], block, split_k=split, **dict(tile, BLOCK_K=32))\n"
        "    torch.testing.assert_close(g.float(), want.float(), atol=2e-2, rtol=1.6e-2)\n"
        "    a, w, offs, s = make_case([0, 3, 1, 0], 24, K, fmt, block, sd)\n"  # split-K over several groups
        "    g = _launch(a, w, offs, s, block, split_k=split, **dict(tile, BLOCK_K=32))\n"
        "    torch.testing.assert_close(g.float(), reference(a, w, offs, s, block).float(), atol=2e-2, rtol=1.6e-2)\n"
        "print('ok')\n")
    run_interpreted(code)


# FP4 codes times E8M0 scales are built as bits in the kernel: read every code under every scale byte
# the kernel is exact for (2..252) back through one-hot rows of A, which must give the dequantised
# weight bit for bit (one nonzero product per output, exact in bf16 and fp32).
FP4_EXACT = (
    "import torch\n"
    "from deepinfer.kernels.grouped_gemm import _launch\n"
    "from deepinfer.formats.quant import dequant_fp4\n"
    "K, N = 64, 256\n"
    "codes = torch.arange(N * K, dtype=torch.int64) % 16\n"        # every code in every column
    "lo, hi = codes.view(N, K)[:, 0::2], codes.view(N, K)[:, 1::2]\n"
    "w = (lo | (hi << 4)).to(torch.uint8).view(torch.int8)\n"
    "s = (2 + torch.arange(N * K // 32) % 251).view(N, K // 32).to(torch.uint8).view(torch.float8_e8m0fnu)\n"
    "a = torch.eye(K, dtype=torch.bfloat16)\n"
    "want = dequant_fp4(w, s, 32, torch.float32).T\n"
    "for cfg in (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)):\n"
    "    got = _launch(a.to(DEV), w.to(DEV), None, s.to(DEV), (1, 32), num_warps=4, num_stages=1, **cfg)\n"
    "    assert torch.equal(got.float().cpu(), want), (got.float().cpu() - want).abs().max()\n"
    "print('ok')\n")
test_fp4_bits_exact_in_the_triton_interpreter, test_fp4_bits_exact_on_gpu = interpreted_and_gpu(
    FP4_EXACT, "DEV = 'cpu'\n", "DEV = 'cuda'\n")


def test_folded_fp4_experts_keep_decode_on_the_scaled_product(tmp_path):
    """FP4 experts repacked as FP8 with scales folded to (1, 128) (layers/moe.py fold_scales) run W8A16
    below the W8A8 threshold: every FP8 tile choice (default_config at any row count, batch-invariant
    GEMM_TILES) has a K tile dividing 128, so one scale spans the tile and multiplies its product (the
    kernel's cheapest FP8 branch) instead of each weight. In the interpreter the folded weights give the
    (1, 32) original's result."""
    from deepinfer.formats.quant import fold_e8m0_groups
    from deepinfer.kernels.grouped_gemm import FP8, default_config
    from deepinfer.layers.invariant import GEMM_TILES

    for M in (1, 6, 64, 384, 2048, 49152):
        assert 128 % default_config(M, 256, FP8, 2048, 132)["BLOCK_K"] == 0, M
    assert 128 % GEMM_TILES["BLOCK_K"] == 0
    a, w, offs, s = make_case([0, 3, 9], 48, 256, "fp8", block=(1, 32), exps=(118, 124))
    fw, fs = zip(*(fold_e8m0_groups(w[e], s[e]) for e in range(3)))
    fw, fs = torch.stack(fw), torch.stack(fs)
    assert fs.shape == (3, 48, 2)
    want = reference(a, w, offs, s, (1, 32))
    assert torch.equal(reference(a, fw, offs, fs, (1, 128)), want)
    pytest.importorskip("triton")
    case = tmp_path / "folded.pt"
    torch.save(dict(a=a, w=fw, offs=offs, s=fs, want=want), case)
    run_interpreted(
        SHIMS +
        "import torch\n"
        "from deepinfer.kernels.grouped_gemm import _launch\n"
        f"d = torch.load({str(case)!r})\n"
        "for bk in (32, 64, 128):\n"
        "    got = _launch(d['a'], d['w'], d['offs'], d['s'], (1, 128), BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk,\n"
        "                  num_warps=1, num_stages=1)\n"
        "    torch.testing.assert_close(got.float(), d['want'].float(), atol=2e-2, rtol=1.6e-2)\n"
        "print('ok')\n")


# ---------------------------------------------------------------- GEMV (few rows per group)

# (fmt, counts, N, K, block, scale dtype, tiles, split_k): one group at M = 1..4 (2-D weight and offs forms),
# groups with ragged / empty / more rows than ROWS, V4's (128, 128) linears and (1, 128) / (1, 32) experts (a
# K tile inside one scale block, or BLOCK_K / 32 blocks a tile), odd blocks (each element scaled), fp32 and
# E8M0 scales, split-K, dense weights (8 bf16 a thread's chunk).
GEMV_CASES = [
    ("fp8", [1], 40, 512, (128, 128), "e8m0", dict(BLOCK_N=16, BLOCK_K=256), 1),
    ("fp8", [2], 40, 512, (128, 128), "e8m0", dict(BLOCK_N=16, BLOCK_K=128), 1),
    ("fp8", [3], 40, 512, (128, 128), "fp32", dict(BLOCK_N=32, BLOCK_K=64), 2),
    ("fp8", [4], 24, 512, (128, 128), "e8m0", dict(BLOCK_N=16, BLOCK_K=256), 2),
    ("fp8", [0, 1, 5, 0, 2, 3], 40, 256, (1, 128), "e8m0", dict(ROWS=1, BLOCK_N=16, BLOCK_K=128), 1),
    ("fp8", [0, 1, 5, 0, 2, 3], 40, 256, (1, 128), "e8m0", dict(ROWS=2, BLOCK_N=16, BLOCK_K=256), 1),
    ("fp8", [0, 1, 5, 0, 2, 3], 40, 256, (1, 32), "e8m0", dict(ROWS=4, BLOCK_N=16, BLOCK_K=128), 1),
    ("fp8", [2, 0, 7], 40, 256, (1, 32), "e8m0", dict(ROWS=2, BLOCK_N=16, BLOCK_K=32), 2),
    ("fp8", [0, 3, 1, 0], 24, 512, (128, 128), "fp32", dict(ROWS=2, BLOCK_N=16, BLOCK_K=128), 2),
    ("fp8", [2, 0, 5], 40, 96, (16, 48), "fp32", dict(ROWS=2, BLOCK_N=16, BLOCK_K=64), 1),
    ("bf16", [2, 0, 3], 40, 256, (128, 128), "e8m0", dict(ROWS=2, BLOCK_N=16, BLOCK_K=64), 2),
]

GEMV_CHECK = (
    "import pathlib, runpy, tempfile\n"
    "import torch\n"
    "from deepinfer.kernels import grouped_gemm as gg\n"
    "from deepinfer.formats.quant import dequant_fp8_blocks\n"
    "from test_grouped_gemm import GEMV_CASES, make_case\n"
    "def run(launch):\n"
    "    for fmt, counts, N, K, block, sd, tiles, split in GEMV_CASES:\n"
    "        a, w, offs, s = (None if t is None else t.to(DEV) for t in make_case(counts, N, K, fmt, block, sd))\n"
    "        want = gg.reference(a, w, offs, s, block).float()\n"
    "        kw = dict(tiles, num_warps=4, num_stages=2, split_k=split, gemv=True)\n"
    "        got = [launch(a, w, offs, s, block, **kw)]\n"
    "        if len(counts) == 1:  # one group: 2-D weight, no offs\n"
    "            got.append(launch(a, w[0], None, None if s is None else s[0], block, **kw))\n"
    "        for g in got:\n"
    "            assert g.shape == want.shape and g.dtype == torch.bfloat16\n"
    "            torch.testing.assert_close(g.float(), want, atol=2e-2, rtol=1.6e-2)\n"
    # exactness: one-hot rows of A read every finite e4m3 code back times its E8M0 scale (subnormals included)
    "    K, N = 128, 256\n"
    "    codes = torch.arange(N * K) % 256\n"
    "    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)  # NaN codes\n"
    "    w = codes.to(torch.uint8).view(torch.float8_e4m3fn).view(N, K)\n"
    "    s = torch.arange(2 * K // 32).to(torch.uint8).add(112).view(2, K // 32).view(torch.float8_e8m0fnu)\n"
    "    a = torch.eye(K, dtype=torch.bfloat16)[:64]\n"
    "    want = dequant_fp8_blocks(w, s, (128, 32), torch.float32).T[:64]\n"
    "    for rows in (1, 4):\n"
    "        got = launch(a.to(DEV), w.to(DEV), None, s.to(DEV), (128, 32), gemv=True, ROWS=rows, BLOCK_N=32,\n"
    "                     BLOCK_K=64, num_warps=4, num_stages=2)\n"
    "        assert torch.equal(got.float().cpu(), want), (got.float().cpu() - want).abs().max()\n"
    "run(gg._launch)\n"
    "if DEV == 'cpu':  # mutants of the GEMV kernel (run from a copy of the module) must fail the same checks\n"
    "    src = pathlib.Path(gg.__file__).read_text()\n"
    "    for old, new in (('(chunk * KV // BI == j)', '(chunk // BI == j)'),\n"
    "                     ('a_rows + 3 * s_am, 3', 'a_rows + 2 * s_am, 3'),\n"
    "                     ('return acc + part * sc if FMT == 1', 'return acc + part if FMT == 1'),\n"
    "                     ('s_se, ONE_GROUP, E_PAD, ROWS)', 's_se, ONE_GROUP, E_PAD, 1)'),\n"
    "                     ('sc = (_e8m0(s) if E8M0 else s.to(tl.float32))[:, None]',\n"
    "                      'sc = (_e8m0(s + 1) if E8M0 else s.to(tl.float32) * 2)[:, None]')):\n"
    "        assert src.count(old) == 1, old\n"
    "        copy = pathlib.Path(tempfile.mkdtemp()) / 'grouped_gemm_mutant.py'\n"
    "        copy.write_text(src.replace(old, new))\n"
    "        try:\n"
    "            run(runpy.run_path(str(copy))['_launch'])\n"
    "        except AssertionError:\n"
    "            continue\n"
    "        raise SystemExit(f'the mutant {new!r} passed the checks')\n"
    "print('ok')\n")
test_gemv_matches_reference_in_the_triton_interpreter, test_gemv_matches_reference_on_gpu = interpreted_and_gpu(
    GEMV_CHECK, "DEV = 'cpu'\n", "DEV = 'cuda'\n")


def test_gemv_dispatch():
    """Default tiles send FP8 at few rows per group to the GEMV (ROWS covering the mean rows per group), the
    rest to the dot kernel; explicit tiles (batch-invariant mode's GEMM_TILES) never reach the GEMV, at any M."""
    from deepinfer.kernels import grouped_gemm as gg
    from deepinfer.kernels.grouped_gemm import (DENSE, FP4, FP8, GEMV_ROWS, GEMV_ROWS_ONE, default_launch,
                                                gemv_config, launch_kwargs, use_gemv)
    from deepinfer.layers.invariant import GEMM_TILES

    assert [use_gemv(M, 1, FP8) for M in range(7)] == [False] + [M <= GEMV_ROWS_ONE for M in range(1, 7)]
    assert use_gemv(6, 256, FP8) and use_gemv(48, 256, FP8) and use_gemv(GEMV_ROWS * 8, 8, FP8)
    assert not use_gemv(GEMV_ROWS * 8 + 1, 8, FP8)
    assert not any(use_gemv(1, E, f) for E in (1, 8, 256) for f in (DENSE, FP4))
    assert [gemv_config(M, 1)["ROWS"] for M in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert gemv_config(6, 256)["ROWS"] == 1 and gemv_config(16, 8)["ROWS"] == 2
    # V4's 4096 x 8192 projection at M = 1: >= 2 programs per SM of the H200's 132
    kw = default_launch(1, 1, FP8, 4096, 8192, 132, True)
    cfg = gemv_config(1, 1)
    assert kw["gemv"] and -(-4096 // kw.get("BLOCK_N", cfg["BLOCK_N"])) * kw["split_k"] >= 2 * 132
    # where the default tiles would split K, the narrow split-free tiles run instead (no split_sum launch)
    assert kw == dict(gemv=True, BLOCK_N=8, BLOCK_K=512, num_warps=2, num_stages=3, split_k=1)
    # N / 8 too few programs for the narrow tiles: 8 x 2048 tiles unsplit (stacked wq_a | wkv); a narrower N splits
    assert default_launch(1, 1, FP8, 1536, 4096, 132, True) == dict(gemv=True, **gg.WIDE_K_GEMV, split_k=1)
    assert default_launch(1, 1, FP8, 512, 4096, 132, True)["split_k"] > 1
    # short K over many columns (wq_b): 16 x 512 tiles without a shared-memory pipeline; few columns: defaults
    assert default_launch(1, 1, FP8, 32768, 1024, 132, True) == dict(gemv=True, **gg.SHORT_K_GEMV, split_k=1)
    assert default_launch(2, 1, FP8, 32768, 1024, 132, True).get("BLOCK_K") != gg.SHORT_K_GEMV["BLOCK_K"]
    assert "BLOCK_N" not in default_launch(1, 1, FP8, 1024, 1024, 132, True)
    assert "gemv" not in default_launch(64, 1, FP8, 4096, 8192, 132, True)
    # one row in each of several groups (V4's wo_a at one token): the narrow tiles unsplit as well; routed experts
    # (fewer rows than groups) keep gemv_config's tiles, unsplit at one token
    assert default_launch(8, 8, FP8, 1024, 4096, 132, False) == dict(gemv=True, BLOCK_N=8, BLOCK_K=512, num_warps=2,
                                                                       num_stages=3, split_k=1)
    assert default_launch(16, 8, FP8, 1024, 4096, 132, False) == dict(gemv=True, split_k=1)  # two rows a group
    assert default_launch(6, 256, FP8, 2048, 4096, 132, False) == dict(gemv=True, split_k=1)
    w8, wd = torch.empty(256, 64, 256, dtype=torch.float8_e4m3fn), torch.empty(256, 64, 256, dtype=torch.bfloat16)
    offs = torch.zeros(256, dtype=torch.int32)
    for M in (1, 2, 4, 6, 48, 512, 4096):
        assert launch_kwargs(M, w8, offs, GEMM_TILES, 132) == GEMM_TILES
        assert launch_kwargs(M, w8[0], None, GEMM_TILES, 132) == GEMM_TILES
        assert launch_kwargs(M, w8, offs, dict(BLOCK_N=64), 132) == dict(BLOCK_N=64)
        assert launch_kwargs(M, wd, offs, dict.fromkeys(GEMM_TILES), 132).get("gemv") is None
    none = dict.fromkeys(GEMM_TILES)
    assert launch_kwargs(1, w8[0], None, none, 132)["gemv"] and launch_kwargs(6, w8, offs, none, 132)["gemv"]


def test_gemv_launch_errors():
    pytest.importorskip("triton")
    from deepinfer.kernels.grouped_gemm import _launch
    a, w, offs, s = make_case([2], 16, 64, "fp8")
    for kw, match in ((dict(ROWS=3), "ROWS must be 1, 2 or 4"), (dict(BLOCK_M=16), "ROWS, not BLOCK_M"),
                      (dict(BLOCK_K=8), "multiple of 16")):
        with pytest.raises(ValueError, match=match):
            _launch(a, w, offs, s, (128, 128), gemv=True, **kw)
    with pytest.raises(ValueError, match="gemv=True"):
        _launch(a, w, offs, s, (128, 128), ROWS=2)
    a, w, offs, s = make_case([2], 16, 64, "fp4")
    with pytest.raises(ValueError, match="FP4 runs the dot kernel"):
        _launch(a, w, offs, s, (128, 128), gemv=True)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,N,K,block", [([1], 4096, 8192, (128, 128)), ([1], 1536, 4096, (128, 128)),
                                              ([1], 32768, 1024, (128, 128)),
                                              ([1] * 6 + [0] * 58, 2048, 4096, (1, 128)),
                                              ([0, 2, 1, 0, 3] + [1] * 40 + [0] * 19, 4096, 2048, (1, 128)),
                                              ([0, 2, 1, 0, 3] + [1] * 40 + [0] * 19, 2048, 4096, (1, 32))])
def test_gemv_default_path_on_gpu(counts, N, K, block, monkeypatch):
    """grouped_gemm's default tiles run the GEMV at V4's decode shapes (Linear at M = 1; experts' N, K and
    scales at 1 and ~8 tokens x 6 rows, over 64 of the 256 experts to keep the host-side case small) and match
    `reference`; with batch-invariant mode's tiles the GEMV kernel is never launched."""
    from deepinfer.kernels import grouped_gemm as gg
    from deepinfer.layers.invariant import GEMM_TILES
    a, w, offs, s = make_case(counts, N, K, "fp8", block, "e8m0", device="cuda", exps=(117, 122))
    if len(counts) == 1:
        w, offs, s = w[0], None, s[0]
    assert gg.launch_kwargs(a.shape[0], w, offs, dict.fromkeys(GEMM_TILES), 132)["gemv"]
    want = reference(a, w, offs, s, block)
    torch.testing.assert_close(grouped_gemm(a, w, offs, s, block).float(), want.float(), atol=3e-2, rtol=2e-2)

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the GEMV was launched")
    monkeypatch.setattr(gg, "_grouped_gemv_kernel", Refuse())
    torch.testing.assert_close(grouped_gemm(a, w, offs, s, block, **GEMM_TILES).float(), want.float(), atol=3e-2,
                               rtol=2e-2)
    with pytest.raises(AssertionError, match="GEMV was launched"):
        grouped_gemm(a, w, offs, s, block)


@pytest.mark.gpu
def test_gemv_replays_in_a_cuda_graph_with_new_offsets():
    from deepinfer.kernels import grouped_gemm as gg
    a, w, offs, s = make_case([2, 0, 5, 1], 256, 512, "fp8", (1, 128), device="cuda")
    assert gg.launch_kwargs(8, w, offs, {}, 132)["gemv"]
    grouped_gemm(a, w, offs, s, (1, 128))  # compile outside the capture
    a1, w1, _, s1 = make_case([1], 1024, 4096, "fp8", device="cuda")
    grouped_gemm(a1, w1[0], None, s1[0])  # one group, split over K
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm(a, w, offs, s, (1, 128))
        out1 = grouped_gemm(a1, w1[0], None, s1[0])
    for counts in ([8, 0, 0, 0], [0, 0, 0, 8], [1, 2, 3, 2], [0, 0, 0, 0]):
        offs.copy_(torch.tensor(counts, device="cuda").cumsum(0))
        a.normal_()
        a1.normal_()
        graph.replay()
        _check(out[:sum(counts)], reference(a, w, offs, s, (1, 128))[:sum(counts)])
        _check(out1, reference(a1, w1[0], None, s1[0]))


def _gemv_builds(launches) -> list:
    """(launch, compiled kernel, ptxas usage) of each distinct GEMV launch recorded, built as the JIT builds
    it on the H200 (tests/kernels/sm90.py, benchmarks/sm90_kernel_resources.py)."""
    from sm90 import compile_sm90, record
    from sm90_kernel_resources import ptxas_usage
    with record() as got:
        launches()
    got = [launch for launch in got if launch.fn.__name__ == "_grouped_gemv_kernel"]
    assert got
    built = []
    for launch in {launch.key: launch for launch in got}.values():
        kernel = compile_sm90(launch, specialize=True)
        built.append((launch, kernel, ptxas_usage(kernel.asm["ptx"])))
    return built


def test_gemv_default_launches_build_for_sm90_without_spills(monkeypatch):
    """test_sm90_compile's GEMV launches (V4's decode linears and experts, default tiles): no spills, at most 128
    registers (4 programs of 4 warps an SM); where the tiles ask for stages, the weight tile pipelined by cp.async
    and no layout conversion inside the K loop (each thread's 16-wide chunks summed where they were loaded).
    SHORT_K_GEMV's single stage loads straight to registers and converts the activations' layout in each of its
    K steps (two at wq_b's K = 1024; faster in gemv_depth_probe.py all the same)."""
    pytest.importorskip("triton")
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from test_sm90_compile import gemv_expert_launches, gemv_linear_launches

    for launch, kernel, usage in _gemv_builds(lambda: (gemv_expert_launches(), gemv_linear_launches())):
        what = (launch.constexprs, launch.options, usage)
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0 and usage["registers"] <= 128, what
        ttgir = kernel.asm["ttgir"]
        staged = launch.options.get("num_stages", 3) > 1
        assert (ttgir.count("ttg.async_copy_global_to_local") >= 1) == staged, what
        loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        assert "ttg.convert_layout" not in loop or not staged, what


def test_gemv_sweep_entries_build_for_sm90_without_spills(monkeypatch):
    """benchmarks/kernel_sweep.py's GEMV entries at V4's 4096 x 8192 projection (M = 1 and 4) and the experts'
    w1 (1 token x 6): each builds for sm_90 within its shared memory, without spills."""
    pytest.importorskip("triton")
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from kernel_sweep import GEMV_EXPERT_SWEEP, GEMV_SWEEP, GEMV_SWEEP_M4, gemv_kwargs
    from test_sm90_compile import SM90_MAX_SHARED
    from deepinfer.kernels.grouped_gemm import _launch

    e4, u8 = torch.float8_e4m3fn, torch.uint8
    assert len(set(GEMV_SWEEP)) == len(GEMV_SWEEP) == 26

    def launches():
        for M, sweep in ((1, GEMV_SWEEP), (4, GEMV_SWEEP_M4)):
            for entry in sweep:
                kw = gemv_kwargs(M, 1, 4096, 8192, True, entry, sms=132)
                _launch(torch.empty(M, 8192, dtype=torch.bfloat16), torch.empty(4096, 8192, dtype=e4), None,
                        torch.zeros(32, 64, dtype=u8), (128, 128), **kw)
        for r, bn, bk, nw, ns in GEMV_EXPERT_SWEEP:
            kw = gemv_kwargs(6, 256, 2048, 4096, False, (bn, bk, nw, ns, None), rows=r, sms=132)
            _launch(torch.empty(6, 4096, dtype=torch.bfloat16), torch.empty(256, 2048, 4096, dtype=e4),
                    torch.zeros(256, dtype=torch.int32), torch.zeros(256, 2048, 32, dtype=u8), (1, 128), **kw)
    for launch, kernel, usage in _gemv_builds(launches):
        assert usage["spill_stores"] == 0 and kernel.metadata.shared <= SM90_MAX_SHARED, (launch.constexprs, usage)


# ---------------------------------------------------------------- the swapped dot (opt-in)

# The swapped dot against the reference (which dequantises the weight to bf16, as the kernel's folded scale does):
# ragged groups, empty ones, a tile-spanning one, one group without offs, (128, 128) and (1, 128) E8M0 blocks,
# dense bf16 weights, a K split; rows past offs[-1] are not compared (left unwritten). Refusals name the rule.
SWAP_CHECK = (
    "import pytest, torch\n"
    "from deepinfer.kernels.grouped_gemm import _launch, reference\n"
    "from test_grouped_gemm import make_case\n"
    "for counts, N, K, fmt, block, extra in [([0, 1, 37, 0, 5, 0], 48, 256, 'fp8', (128, 128), {}),\n"
    "                                        ([3, 20], 40, 256, 'fp8', (1, 128), {}),\n"
    "                                        ([19], 32, 128, 'bf16', (128, 128), {}),\n"
    "                                        ([4, 0, 9], 64, 512, 'fp8', (128, 128), dict(split_k=2))]:\n"
    "    a, w, offs, s = make_case(counts, N, K, fmt, block=block)\n"
    "    want = reference(a, w, offs, s, block)\n"
    "    n = sum(counts)\n"
    "    got = _launch(a.to(DEV), w.to(DEV), offs.to(DEV), None if s is None else s.to(DEV), block, swap=True,\n"
    "                  **TILES, **extra).cpu()\n"
    "    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=2e-2, rtol=1.6e-2)\n"
    "    if len(counts) == 1:\n"
    "        one = _launch(a.to(DEV), w[0].to(DEV), None, None if s is None else s[0].to(DEV), block, swap=True,\n"
    "                      **TILES).cpu()\n"
    "        assert torch.equal(one, got)\n"
    "a, w, offs, s = make_case([5], 32, 256, 'fp8', scale_dtype='fp32')\n"
    "with pytest.raises(ValueError, match='swap=True'):\n"
    "    _launch(a.to(DEV), w.to(DEV), offs.to(DEV), s.to(DEV), (128, 128), swap=True, **TILES)\n"
    "a, w, offs, s = make_case([5], 32, 256, 'fp8', block=(1, 32))\n"
    "with pytest.raises(ValueError, match='swap=True'):\n"
    "    _launch(a.to(DEV), w.to(DEV), offs.to(DEV), s.to(DEV), (1, 32), swap=True, **dict(TILES, BLOCK_K=64))\n"
    "print('ok')\n")
test_swap_matches_reference_in_the_triton_interpreter, test_swap_matches_reference_on_gpu = interpreted_and_gpu(
    SWAP_CHECK, "DEV = 'cpu'\nTILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1)\n",
    "DEV = 'cuda'\nTILES = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)\n")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 32, 64])
@pytest.mark.parametrize("tiles", [dict(BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_N=128, num_warps=8, num_stages=3)])
def test_swap_at_v4_sizes_on_gpu(M, tiles):
    """The swapped dot at a V4 projection's size (4096 x 4096, (128, 128) E8M0 blocks) and over ragged routed
    experts ((1, 128) blocks), against the reference; one K split and two."""
    from deepinfer.kernels.grouped_gemm import _launch
    bm = min(64, max(16, 1 << (M - 1).bit_length()))
    for counts, N, K, block in (([M], 4096, 4096, (128, 128)), ([0, M, 1, 0, 2 * M, 3], 2048, 4096, (1, 128))):
        a, w, offs, s = make_case(counts, N, K, "fp8", block=block, device="cuda", seed=M)
        want = reference(a, w, offs, s, block)
        n = sum(counts)
        for sk in (1, 2):
            got = _launch(a, w, offs, s, block, swap=True, split_k=sk, BLOCK_M=bm, BLOCK_K=128, **tiles)
            torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=2e-2, rtol=1.6e-2)


def test_swap_dispatch():
    """Default tiles send one FP8 group with E8M0 blocks (K blocks a multiple of 128) at 2 .. SWAP_ROWS - 1 rows
    to the swapped dot (its row tile the next power of two from 16 to 64); one row stays on the GEMV, SWAP_ROWS
    and more, fp32 scales, (1, 32) blocks, several groups and explicit tiles on the dot kernel / GEMV."""
    from deepinfer.kernels.grouped_gemm import SWAP_ROWS, launch_kwargs
    from deepinfer.layers.invariant import GEMM_TILES

    w = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    e8 = torch.empty(32, 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    f32 = torch.empty(32, 32)
    none = dict.fromkeys(GEMM_TILES)
    for M in (2, 3, 16, 17, 33, SWAP_ROWS - 1):
        kw = launch_kwargs(M, w, None, none, 132, e8, (128, 128))
        assert kw["swap"] and kw["BLOCK_M"] == min(64, max(16, 1 << (M - 1).bit_length())), (M, kw)
        assert launch_kwargs(M, w, None, GEMM_TILES, 132, e8, (128, 128)) == GEMM_TILES
        assert "swap" not in launch_kwargs(M, w, None, none, 132, f32, (128, 128))
        assert "swap" not in launch_kwargs(M, w, None, none, 132, e8, (1, 32))
        assert "swap" not in launch_kwargs(M, w, None, none, 132)
    assert launch_kwargs(1, w, None, none, 132, e8, (128, 128))["gemv"]
    assert "swap" not in launch_kwargs(SWAP_ROWS, w, None, none, 132, e8, (128, 128))
    w3, offs = torch.empty(8, 1024, 4096, dtype=torch.float8_e4m3fn), torch.zeros(8, dtype=torch.int32)
    assert "swap" not in launch_kwargs(16, w3, offs, none, 132, e8.new_empty(8, 8, 32), (128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 17, 63])
def test_swap_default_matches_reference_on_gpu(M):
    """grouped_gemm with default tiles (the swapped dot at these rows) on V4's 4096 x 8192 projection."""
    from deepinfer.kernels.grouped_gemm import grouped_gemm, launch_kwargs
    a, w, offs, s = make_case([M], 4096, 8192, "fp8", block=(128, 128), device="cuda", seed=M)
    w, s = w[0], s[0]
    assert launch_kwargs(M, w, None, {}, 132, s, (128, 128))["swap"]
    want = reference(a, w, None, s, (128, 128))
    torch.testing.assert_close(grouped_gemm(a, w, None, s).float(), want.float(), atol=2e-2, rtol=1.6e-2)
