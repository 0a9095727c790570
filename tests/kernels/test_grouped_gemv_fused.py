"""grouped_gemv_fused: routed experts' w1 and w3 in one GEMV launch (pair), the shared expert as their last group
(extra). Each output element must be the separate GEMVs' (same tiles), bit for bit."""
import pytest
import torch

from deepinfer.kernels.grouped_gemm import fused_layout_error, fused_reference, grouped_gemv_fused
from interpreter import interpreted_and_gpu

# (routed rows per expert, extra rows, N, K, expert block, extra block, tiles, split_k)
FUSED_CASES = [
    ([1, 0, 1, 1, 0], 2, 144, 256, (1, 128), (128, 128), dict(ROWS=1, BLOCK_N=16, BLOCK_K=128), 1),
    ([2, 0, 1], 1, 32, 256, (1, 128), (128, 128), dict(ROWS=2, BLOCK_N=32, BLOCK_K=128), 2),
    ([0, 2, 1], 2, 32, 512, (1, 128), (128, 128), dict(ROWS=1, BLOCK_N=16, BLOCK_K=256), 1),
    ([1, 0, 1], 1, 32, 384, (1, 128), (128, 128), dict(ROWS=1, BLOCK_N=16, BLOCK_K=256), 1),  # K: 1.5 K tiles
    ([1, 0, 1], 1, 32, 128, (1, 32), (32, 32), dict(ROWS=1, BLOCK_N=16, BLOCK_K=128), 1),  # V4.1's 32-wide blocks
]

FUSED_CHECK = (
    "import pathlib, runpy, tempfile\n"
    "import torch\n"
    "from deepinfer.kernels import grouped_gemm as gg\n"
    "from test_grouped_gemm import make_case\n"
    "from test_grouped_gemv_fused import FUSED_CASES, extra_weight\n"
    "WANT = {}  # the separate GEMVs (this module's, never a mutant's), computed once per case and weight\n"
    "def separate(key, *args, **kw):\n"
    "    if key not in WANT:\n"
    "        WANT[key] = gg._launch(*args, gemv=True, **kw)\n"
    "    return WANT[key]\n"
    "def run(fused, cases=FUSED_CASES, variants=3):\n"
    "    for ci, (counts, nx, N, K, block, bx, tiles, split) in enumerate(cases):\n"
    "        a, w1, offs, s1 = make_case(counts + [nx], N, K, 'fp8', block, seed=1)\n"
    "        _, w3, _, s3 = make_case(counts, N, K, 'fp8', block, seed=2)\n"
    "        w1, s1 = w1[:-1], s1[:-1]\n"
    "        x1, x3 = extra_weight(N, K, bx, 3), extra_weight(N, K, bx, 4)\n"
    "        a, w1, offs, s1, w3, s3 = (t.to(DEV) for t in (a, w1, offs, s1, w3, s3))\n"
    "        x1, x3 = ((w.to(DEV), s.to(DEV)) for w, s in (x1, x3))\n"
    "        kw = dict(tiles, num_warps=4, num_stages=2, split_k=split)\n"
    "        lo = int(offs[-2])\n"
    "        for pair, extra in (((w3, s3), (x1, x3)), ((w3, s3), None), (None, x1))[:variants]:\n"
    "            o = offs if extra is not None else offs[:-1]\n"
    "            rows = a if extra is not None else a[:lo]\n"
    "            got = fused(rows, [(w1, s1)] + ([pair] if pair else []), None if extra is None else\n"
    "                        (list(extra) if pair else [extra]), o, block, bx, 132, **kw)\n"
    "            halves = [(w1, s1, x1)] + ([(w3, s3, x3)] if pair else [])\n"
    "            assert got.shape == (rows.shape[0], N * len(halves)) and got.dtype == torch.bfloat16\n"
    "            for h, (w, s, (wx, sx)) in enumerate(halves):\n"
    "                part = got[:, h * N:(h + 1) * N]\n"
    "                want = separate((ci, h, 0), a[:lo], w, offs[:-1], s, block, **kw)\n"
    "                assert torch.equal(part[:lo], want), ('routed', h, counts, tiles)\n"
    "                if extra is not None:\n"
    "                    want = separate((ci, h, 1), a[lo:], wx, None, sx, bx, **kw)\n"
    "                    assert torch.equal(part[lo:], want), ('extra', h, counts, tiles)\n"
    "            ref = gg.fused_reference(rows.cpu(), w1.cpu(), s1.cpu(), o.cpu(), block,\n"
    "                                     None if pair is None else tuple(t.cpu() for t in pair),\n"
    "                                     None if extra is None else (tuple(tuple(t.cpu() for t in e) for e in extra)\n"
    "                                                                 if pair else tuple(t.cpu() for t in extra)), bx)\n"
    "            torch.testing.assert_close(got.float().cpu(), ref.float(), atol=2e-2, rtol=1.6e-2)\n"
    "run(gg._launch_fused)\n"
    "if DEV == 'cpu':  # mutants of the fused paths (run from a copy of the module) must fail the same checks\n"
    "    src = pathlib.Path(gg.__file__).read_text()\n"
    "    for old, new in (('(cols + half * N) * s_on', 'cols * s_on'),\n"
    "                     ('srow = tl.where(last, cols // BO_EXTRA, srow)', 'srow = srow'),\n"
    "                     ('w_ptr + extra_w + half * extra_pair_w', 'w_ptr + extra_w'),\n"
    "                     ('s_ptr + extra_s + half * extra_pair_s', 's_ptr + extra_s'),\n"
    "                     ('last = row0 >= tl.load(offs_ptr + E - 2)', 'last = row0 >= tl.load(offs_ptr + E - 1)'),\n"
    "                     ('w_base += half * pair_w', 'w_base += 0')):\n"
    "        assert src.count(old) == 1, old\n"
    "        copy = pathlib.Path(tempfile.mkdtemp()) / 'grouped_gemm_mutant.py'\n"
    "        copy.write_text(src.replace(old, new))\n"
    "        try:\n"
    "            run(runpy.run_path(str(copy))['_launch_fused'], FUSED_CASES[:1], 2)\n"
    "        except AssertionError:\n"
    "            continue\n"
    "        raise SystemExit(f'the mutant {new!r} passed the checks')\n"
    "print('ok')\n")
test_fused_gemv_matches_separate_gemvs_in_the_triton_interpreter, test_fused_gemv_matches_separate_gemvs_on_gpu = \
    interpreted_and_gpu(FUSED_CHECK, "DEV = 'cpu'\n", "DEV = 'cuda'\n")


def extra_weight(N: int, K: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared expert's FP8 weight [N, K] with E8M0 scales per `block`."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 4).to(torch.float8_e4m3fn)
    s = torch.randint(118, 126, (-(-N // block[0]), -(-K // block[1])), generator=g, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def test_layout_errors_name_the_argument():
    from test_grouped_gemm import make_case

    a, w, offs, s = make_case([1, 2, 1], 64, 256, "fp8", (1, 128))
    wx, sx = extra_weight(64, 256, (128, 128), 0)
    assert fused_layout_error(w, s, 4, None, (wx, sx), (128, 128), (1, 128)) is None
    assert "offs" in fused_layout_error(w, s, 3, None, (wx, sx), (128, 128), (1, 128))  # 3 + 1 groups
    assert "pair" in fused_layout_error(w, s, 3, (w[:, :32], s[:, :32]), None, None, (1, 128))
    assert "extra weight" in fused_layout_error(w, s, 4, None, (wx.t().contiguous().t(), sx), (128, 128), (1, 128))
    assert "extra" in fused_layout_error(w, s, 4, None, (wx, sx), (128, 64), (1, 128))
    assert "E8M0" in fused_layout_error(w, s.float(), 3)
    with pytest.raises(ValueError, match="grouped_gemv_fused: pair"):
        grouped_gemv_fused(a, w, s, offs, (1, 128), pair=(w[:, :32], s[:, :32]))


def test_reference_is_the_groups_through_their_weights():
    """CPU: grouped_gemv_fused is fused_reference; the extra group's rows go through the extra weight only."""
    from test_grouped_gemm import make_case

    a, w, offs, s = make_case([1, 0, 2, 2], 64, 256, "fp8", (1, 128))
    w, s = w[:-1], s[:-1]
    _, w3, _, s3 = make_case([1, 0, 2], 64, 256, "fp8", (1, 128), seed=5)
    x1, x3 = extra_weight(64, 256, (128, 128), 1), extra_weight(64, 256, (128, 128), 2)
    got = grouped_gemv_fused(a, w, s, offs, (1, 128), pair=(w3, s3), extra=(x1, x3), extra_block=(128, 128))
    assert torch.equal(got, fused_reference(a, w, s, offs, (1, 128), (w3, s3), (x1, x3), (128, 128)))
    from deepinfer.kernels.grouped_gemm import reference

    assert torch.equal(got[:3, :64], reference(a[:3], w, offs[:-1], s, (1, 128)))
    assert torch.equal(got[:3, 64:], reference(a[:3], w3, offs[:-1], s3, (1, 128)))
    assert torch.equal(got[3:, :64], reference(a[3:], x1[0], None, x1[1], (128, 128)))
    assert torch.equal(got[3:, 64:], reference(a[3:], x3[0], None, x3[1], (128, 128)))
