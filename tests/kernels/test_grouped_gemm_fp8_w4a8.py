"""grouped_gemm_fp8 on packed FP4 weights (W4A8, kernels/grouped_gemm_fp8.py): the e2m1 -> e4m3 bit trick on
every code, `reference` (dequant_fp4), argument errors, the Triton kernel against the reference in the
interpreter (CPU) and compiled (GPU: the PTX nibble conversion and the plain Triton one), a mutation check
that a wrong nibble order is caught, the decode launches built for sm_90 without spills.

The kernel multiplies the same e4m3 operands as `reference` (e2m1 codes are exact in e4m3, products exact
in fp32) and applies the same power-of-two scales; only fp32 summation order differs, so they agree to bf16
output rounding (the interpreter truncates fp32 -> bf16, hence its looser bound)."""
import pytest
import torch
import torch.nn.functional as F

from deepinfer.formats.quant import FP4_VALUES, dequant_fp4
from deepinfer.kernels import grouped_gemm
from deepinfer.kernels.act_quant import reference as act_quant
from deepinfer.kernels.grouped_gemm_fp8 import grouped_gemm_fp8, reference
from interpreter import interpreted_and_gpu


def make_w4_case(counts, N, K, extra_rows=0, seed=0, scale_lo=112, scale_hi=124, device="cpu"):
    """Rows sorted by expert (counts[e] each, then `extra_rows` past offs[-1]) quantised by act_quant's reference;
    packed FP4 weights [E, N, K/2] with every byte value (so every code in both nibbles) and E8M0 scales
    [E, N, K/32] drawn from scale_lo .. scale_hi - 1 per (row, 32-group)."""
    g = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts) + extra_rows
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q, s = act_quant(x, 128)
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    ws = torch.randint(scale_lo, scale_hi, (E, N, K // 32), generator=g, dtype=torch.uint8)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    move = lambda t: t.to(device)  # noqa: E731
    return move(x), move(q), move(s), move(w), move(ws.view(torch.float8_e8m0fnu)), move(offs)


def swap_nibbles(w: torch.Tensor) -> torch.Tensor:
    b = w.view(torch.uint8)
    return ((b >> 4) | (b << 4)).view(w.dtype)


def col_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst relative Frobenius distance over output columns (columns of very different scales each count;
    each column divided by its largest magnitude first, so the norms neither overflow nor underflow)."""
    unit = want.float().abs().amax(dim=0).clamp_min(1e-38)
    got, want = got.float() / unit, want.float() / unit
    return float(((got - want).norm(dim=0) / want.norm(dim=0).clamp_min(1e-30)).max())


def test_e2m1_nibble_bits_are_exact_e4m3_times_2_pow_minus_6():
    """The claim the kernel rests on, over all 16 codes and all 256 bytes: the nibble's sign to bit 7 and its
    e1 e0 m bits to bits 4..2 give the e4m3 value e2m1(code) * 2^-6 (code 1, 0.5, as the e4m3 subnormal
    4/8 * 2^-6); the whole-byte forms give the low and the high nibble's code byte."""
    n = torch.arange(16, dtype=torch.int32)
    bits = (((n & 7) << 2) | ((n & 8) << 4)).to(torch.uint8)
    as_e4m3 = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(as_e4m3 * 64, torch.tensor(FP4_VALUES))
    assert torch.equal(torch.signbit(as_e4m3), n >= 8)                   # -0.0 keeps its sign
    b = torch.arange(256, dtype=torch.int32)
    lo = ((b & 0x07) << 2) | ((b & 0x08) << 4)
    hi = ((b >> 2) & 0x1C) | (b & 0x80)
    assert torch.equal(lo, bits.int()[b & 15]) and torch.equal(hi, bits.int()[b >> 4])


def test_reference_is_the_dequantised_fp4_product_per_expert():
    """Each expert's rows: (q * s_a) @ dequant_fp4(W_e)^T in fp32; rows past offs[-1] zero; close to the W4A16
    product of the bf16 activations (grouped_gemm's FP4 path: e4m3 activations ~2^-5 relative)."""
    x, q, s, w, ws, offs = make_w4_case([3, 0, 20, 1], 48, 384, extra_rows=2)
    got = reference(q, s, w, ws, offs, 128, (1, 32))
    assert got.dtype == torch.bfloat16 and got.shape == (26, 48)
    a = q.float() * s.repeat_interleave(128, 1)
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 23), (23, 24)]):
        want = F.linear(a[lo:hi], dequant_fp4(w[e], ws[e], 32))
        torch.testing.assert_close(got[lo:hi].float(), want, atol=0, rtol=2 ** -8)
    assert not got[24:].any()
    w4a16 = grouped_gemm.reference(x, w, offs, ws, (1, 32))
    assert float((got[:24].float() - w4a16[:24].float()).norm() / w4a16[:24].float().norm()) < 0.04
    assert torch.equal(grouped_gemm_fp8(q, s, w, ws, offs, 128, (1, 32)), got)  # CPU: the reference
    assert torch.equal(reference(q, s, w.view(torch.uint8), ws.view(torch.uint8), offs, 128, (1, 32)), got)


def test_bad_packed_arguments_name_the_field():
    x, q, s, w, ws, offs = make_w4_case([3, 2], 48, 256)
    with pytest.raises(ValueError, match="w_scale"):
        reference(q, s, w, ws[:, :, :4], offs, 128, (1, 32))
    with pytest.raises(TypeError, match="w_scale"):
        reference(q, s, w, ws.view(torch.uint8).float(), offs, 128, (1, 32))   # fp32 scales: not E8M0
    with pytest.raises(ValueError, match="block"):
        reference(q, s, w, ws, offs, 128, (1, 128))
    with pytest.raises(ValueError, match="a_scale"):
        reference(q, s[:, :1], w, ws, offs, 128, (1, 32))
    with pytest.raises(ValueError, match="offs"):
        reference(q, s, w, ws, offs[:1], 128, (1, 32))
    with pytest.raises(ValueError, match=r"\[E, N, K/2\]"):
        reference(q, s, w[:, :, :64], ws, offs, 128, (1, 32))                # K/2 = 64 is not 256 / 2
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        reference(x, s, w, ws, offs, 128, (1, 32))
    q48, s48 = act_quant(torch.randn(5, 48).to(torch.bfloat16), 128)
    with pytest.raises(ValueError, match="K % 32"):
        reference(q48, s48, torch.zeros(2, 8, 24, dtype=torch.int8), torch.zeros(2, 8, 1, dtype=torch.uint8),
                  offs, 128, (1, 32))


def test_packed_launch_choices_are_checked():
    pytest.importorskip("triton")
    from deepinfer.kernels.grouped_gemm_fp8 import _launch
    x, q, s, w, ws, offs = make_w4_case([3, 2], 48, 256)
    with pytest.raises(ValueError, match="variant"):
        _launch(q, s, w, ws, offs, 128, (1, 32), variant="tma")
    with pytest.raises(ValueError, match="BLOCK_K"):
        _launch(q, s, w, ws, offs, 128, (1, 32), BLOCK_K=256)   # two activation groups in one K step
    with pytest.raises(ValueError, match="BLOCK_K"):
        _launch(q, s, w, ws, offs, 128, (1, 32), BLOCK_K=96)
    with pytest.raises(ValueError, match="BLOCK_K"):
        _launch(q, s, w, ws, offs, 128, (1, 32), BLOCK_K=16)


# Ragged expert offsets (empty experts first, between and last, one-row experts, a tile-spanning one), rows
# past offs[-1] (unwritten by the kernel: only rows < offs[-1] compared), ragged N, K = 192 and 96 (not
# multiples of 128: the last activation group and K step are partial), K steps of 32 / 64 / 128, every byte
# value in the weights (all 16 codes in both nibbles), per-(row, group) scale bytes, act_quant's column-major
# activation scales with int8 weights and row-major ones with the same bytes as uint8; then scale bytes
# across E8M0's range (20 .. 229, a few bytes per output column so each column's magnitude is its own:
# compared column by column); 64-wide activation groups (the default K step follows the group); then the
# same launch against the reference of the nibble-swapped weight (must be far off: the check sees a wrong
# nibble order).
CHECK = (
    "import torch\n"
    "from deepinfer.kernels.grouped_gemm_fp8 import _launch, reference\n"
    "from test_grouped_gemm_fp8_w4a8 import make_w4_case, col_rel_err, swap_nibbles\n"
    "def rel(got, want):\n"
    "    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))\n"
    "cases = [([0, 1, 37, 0, 5, 0], 40, 256, 3, dict(TILES, BLOCK_K=64)),\n"
    "         ([2, 0, 19], 40, 192, 0, TILES),\n"
    "         ([4, 9], 24, 96, 1, dict(TILES, BLOCK_K=32)),\n"
    "         ([0, 0, 0], 16, 128, 4, TILES),\n"
    "         ([17], 24, 128, 0, TILES)] + EXTRA\n"
    "for counts, N, K, extra, tiles in cases:\n"
    "    x, q, s, w, ws, offs = make_w4_case(counts, N, K, extra)\n"
    "    want = reference(q, s, w, ws, offs, 128, (1, 32))\n"
    "    n = sum(counts)\n"
    "    for sa, wv in ((s, w), (s.contiguous(), w.view(torch.uint8))):\n"
    "        got = _launch(q.to(DEV), sa.to(DEV), wv.to(DEV), ws.to(DEV), offs.to(DEV), 128, (1, 32), **tiles).cpu()\n"
    "        assert got.shape == (n + extra, N) and got.dtype == torch.bfloat16\n"
    "        torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=2e-2, rtol=1.6e-2)\n"
    "        assert n == 0 or rel(got[:n], want[:n]) < REL, (counts, N, K)\n"
    "x, q, s, w, ws, offs = make_w4_case([5, 0, 30, 2], 64, 256, 0, seed=1)\n"
    "wide = torch.linspace(20, 229, 64).round().to(torch.uint8)[None, :, None] + torch.randint(0, 3, (4, 64, 8),\n"
    "    dtype=torch.uint8)\n"
    "ws = wide.view(torch.float8_e8m0fnu)\n"
    "want = reference(q, s, w, ws, offs, 128, (1, 32))\n"
    "got = _launch(q.to(DEV), s.to(DEV), w.to(DEV), ws.to(DEV), offs.to(DEV), 128, (1, 32), **TILES).cpu()\n"
    "assert want.float().abs().amax() > 2.0 ** 90 and want.float().abs()[want != 0].amin() < 2.0 ** -90\n"
    "assert col_rel_err(got, want) < REL, col_rel_err(got, want)\n"
    "from deepinfer.kernels.act_quant import reference as act_quant\n"
    "x, q, s, w, ws, offs = make_w4_case([2, 0, 7], 24, 192, 0, seed=4)\n"
    "q, s = act_quant(x, 64)\n"                                   # 64-wide activation groups: K steps of 64
    "plain = {k: v for k, v in TILES.items() if k != 'BLOCK_K'}\n"
    "got = _launch(q.to(DEV), s.to(DEV), w.to(DEV), ws.to(DEV), offs.to(DEV), 64, (1, 32), **plain).cpu()\n"
    "assert rel(got, reference(q, s, w, ws, offs, 64, (1, 32))) < REL\n"
    "x, q, s, w, ws, offs = make_w4_case([3, 40, 0, 9], 48, 256, 0, seed=2)\n"
    "got = _launch(q.to(DEV), s.to(DEV), w.to(DEV), ws.to(DEV), offs.to(DEV), 128, (1, 32), **TILES).cpu()\n"
    "assert rel(got, reference(q, s, w, ws, offs, 128, (1, 32))) < REL\n"
    "assert rel(got, reference(q, s, swap_nibbles(w), ws, offs, 128, (1, 32))) > 0.5\n"
    "print('ok')\n")

test_w4a8_kernel_in_the_triton_interpreter, test_w4a8_kernel_on_gpu = interpreted_and_gpu(
    CHECK, "DEV = 'cpu'\nREL = 8e-3\nEXTRA = []\nTILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=1, "
    "num_stages=1)\n",
    "DEV = 'cuda'\nREL = 4e-3\nTILES = {}\n"
    "EXTRA = [([3, 0, 2, 1] * 64, 2048, 4096, 5, {}),\n"                             # decode: 16-row tiles (mma.sync)
    "         ([3, 0, 2, 1] * 64, 4096, 2048, 0, dict(BLOCK_M=64)),\n"                # the same on wgmma
    "         ([1, 0, 2, 3] * 64, 4096, 2048, 0, dict(asm=False)),\n"                # the plain nibble conversion
    "         ([300, 0, 129, 1] * 4, 2048, 4096, 7, dict(BLOCK_N=64, num_stages=3))]\n")


# Mutation check of the kernel itself (interpreter): its nibble conversion replaced by one that swaps the two
# planes must fail the comparison the tests above make.
MUTANT = (
    "import torch, triton, triton.language as tl\n"
    "import deepinfer.kernels.grouped_gemm_fp8 as g8\n"
    "from test_grouped_gemm_fp8_w4a8 import make_w4_case\n"
    "x, q, s, w, ws, offs = make_w4_case([3, 0, 21, 2], 32, 256, 0, seed=3)\n"
    "want = g8.reference(q, s, w, ws, offs, 128, (1, 32)).float()\n"
    "tiles = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=1, num_stages=1)\n"
    "rel = lambda got: float((got.float() - want).norm() / want.norm())\n"
    "assert rel(g8._launch(q, s, w, ws, offs, 128, (1, 32), **tiles)) < 8e-3\n"
    "right = g8._e2m1_as_e4m3\n"
    "@triton.jit\n"
    "def swapped(b, ASM: tl.constexpr):\n"
    "    lo, hi = right(b, ASM)\n"
    "    return hi, lo\n"
    "g8._e2m1_as_e4m3 = swapped\n"
    "assert rel(g8._launch(q, s, w, ws, offs, 128, (1, 32), **tiles)) > 0.5\n"
    "print('ok')\n")


def test_a_swapped_nibble_order_fails_the_check():
    pytest.importorskip("triton")
    from interpreter import SHIMS, run_interpreted
    run_interpreted(SHIMS + MUTANT)


def test_w4a8_launches_build_for_sm90_without_spills(monkeypatch):
    """test_sm90_compile's W4A8 launches built as the JIT builds them on the H200 (specialised; cp.async
    pipelined; shared memory is checked there): no register spills (ptxas -v, benchmarks/sm90_kernel_resources.py),
    the activation and weight tiles pipelined, and the PTX nibble conversion present where asm is on."""
    pytest.importorskip("triton")
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90 import compile_sm90, record
    from sm90_kernel_resources import ptxas_usage
    from test_sm90_compile import w4a8_expert_launches

    with record() as got:
        w4a8_expert_launches()
    assert {launch.fn.__name__ for launch in got} == {"_grouped_gemm_w4a8_kernel"}
    assert [launch.constexprs["BLOCK_M"] for launch in got[::8]] == [16, 16, 64]  # w4a8_config at 6, 384, 16386 rows
    for launch in {launch.key: launch for launch in got}.values():
        kernel = compile_sm90(launch, specialize=True)
        usage = ptxas_usage(kernel.asm["ptx"])
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (launch.constexprs, launch.options, usage)
        assert kernel.asm["ttgir"].count("ttg.async_copy_global_to_local") >= 2
        assert ("0x1C1C1C1C" in kernel.asm["ptx"]) == launch.constexprs["ASM"]


def test_bench_sweep_entries_build_for_sm90_without_spills(monkeypatch):
    """benchmarks/fp8_gemm_bench.py's W4A8_SWEEP at decode batch 64's w1 launch (384 rows, N 2048, K 4096): each
    entry is a launch of the W4A8 kernel with the tiles it names, within sm_90's shared memory, without spills."""
    pytest.importorskip("triton")
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from fp8_gemm_bench import W4A8_SWEEP
    from sm90 import compile_sm90, record
    from sm90_kernel_resources import ptxas_usage
    from test_sm90_compile import SM90_MAX_SHARED
    from deepinfer.kernels.grouped_gemm_fp8 import _launch

    E, M, N, K = 256, 384, 2048, 4096
    args = (torch.empty(M, K, dtype=torch.float8_e4m3fn), torch.empty(K // 128, M).t(),
            torch.empty(E, N, K // 2, dtype=torch.int8), torch.zeros(E, N, K // 32, dtype=torch.uint8),
            torch.zeros(E, dtype=torch.int32), 128, (1, 32))
    assert len({tuple(sorted(e.items())) for e in W4A8_SWEEP}) == len(W4A8_SWEEP)
    for entry in W4A8_SWEEP:
        with record() as got:
            _launch(*args, **entry)
        (launch,) = got
        assert launch.fn.__name__ == "_grouped_gemm_w4a8_kernel"
        assert {k: launch.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")} == {
            k: entry[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        kernel = compile_sm90(launch, specialize=True)
        usage = ptxas_usage(kernel.asm["ptx"])
        assert usage["spill_stores"] == 0 and kernel.metadata.shared <= SM90_MAX_SHARED, (entry, usage)


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(2048, 4096), (4096, 2048)])
@pytest.mark.parametrize("tokens,tiles", [(1, {}), (64, {}), (64, dict(BLOCK_M=64)), (2048, {})])
def test_expert_shapes_match_the_reference_and_the_plain_conversion_on_gpu(N, K, tokens, tiles):
    """V4-Flash's experts (256, top-6), routing at random, w4a8_config's tiles (16 rows at 1 and 64 tokens, 64 at
    2048) and 64-row tiles at decode: the kernel within bf16 rounding of `reference`, and the PTX nibble
    conversion bit for bit equal to the plain Triton one (same operands, same dots)."""
    from deepinfer.kernels.act_quant import act_quant as act_quant_gpu
    torch.manual_seed(N + tokens)
    with torch.device("cuda"):
        idx = torch.rand(tokens, 256).topk(6, dim=1).indices
        offs = torch.bincount(idx.flatten(), minlength=256).cumsum(0).to(torch.int32)
        q, s = act_quant_gpu(torch.randn(tokens * 6, K, dtype=torch.bfloat16))
        w = torch.randint(-128, 128, (256, N, K // 2), dtype=torch.int8)
        ws = torch.randint(112, 124, (256, N, K // 32), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = grouped_gemm_fp8(q, s, w, ws, offs, 128, (1, 32), **tiles)
    want = reference(q, s, w, ws, offs, 128, (1, 32))
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 4e-3
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
    from deepinfer.kernels.grouped_gemm_fp8 import _launch
    assert torch.equal(_launch(q, s, w, ws, offs, 128, (1, 32), asm=False, **tiles), got)


@pytest.mark.gpu
def test_w4a8_replays_in_a_cuda_graph_with_new_offsets():
    x, q, s, w, ws, offs = make_w4_case([30, 0, 50, 24], 1024, 2048, device="cuda")
    grouped_gemm_fp8(q, s, w, ws, offs, 128, (1, 32))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm_fp8(q, s, w, ws, offs, 128, (1, 32))
    for counts in ([104, 0, 0, 0], [0, 0, 0, 104], [10, 70, 4, 20]):
        offs.copy_(torch.tensor(counts, device="cuda").cumsum(0))
        graph.replay()
        want = reference(q, s, w, ws, offs, 128, (1, 32))
        assert float((out.float() - want.float()).norm() / want.float().norm()) < 4e-3
