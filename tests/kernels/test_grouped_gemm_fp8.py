"""Grouped FP8 x FP8 GEMM (kernels/grouped_gemm_fp8.py): its reference's math, the Triton kernel against
it on ragged expert offsets (interpreter on the CPU, compiled on the GPU), the prefill launches compiled
for sm_90, CUDA-graph replay with new offsets.

The kernel and `reference` multiply the same e4m3 operands (products exact in fp32) and differ in fp32
summation order and where the scales are applied: they agree to bf16 output rounding (the interpreter
truncates fp32 -> bf16, hence its looser relative bound)."""
import pytest
import torch
import torch.nn.functional as F

from deepinfer.formats.quant import dequant_fp8_blocks
from deepinfer.kernels import grouped_gemm
from deepinfer.kernels.act_quant import reference as act_quant
from deepinfer.kernels.grouped_gemm_fp8 import grouped_gemm_fp8, reference
from interpreter import interpreted_and_gpu


def make_case(counts, N, K, block=(1, 128), scale_dtype="e8m0", extra_rows=0, seed=0, device="cpu"):
    """Rows sorted by expert (counts[e] each, then `extra_rows` past offs[-1]), quantised by act_quant's
    reference; e4m3 weights over every code range with E8M0 block scales 2^-8 .. 2^-3 (or fp32)."""
    g = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts) + extra_rows
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q, s = act_quant(x, 128)
    w = (torch.randn(E, N, K, generator=g) * 4).to(torch.float8_e4m3fn)
    shape = (E, -(-N // block[0]), -(-K // block[1]))
    ws = torch.randint(119, 125, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    if scale_dtype == "fp32":
        ws = torch.rand(shape, generator=g) * 0.03 + 0.002
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    move = lambda t: t.to(device)  # noqa: E731
    return move(x), move(q), move(s), move(w), move(ws), move(offs)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def test_reference_is_the_dequantised_product_per_expert():
    """Each expert's rows: (q * s_a) @ dequant(W_e)^T in fp32; rows past offs[-1] zero; close to the W8A16
    product of the bf16 activations (e4m3 activations: ~2^-5 relative)."""
    x, q, s, w, ws, offs = make_case([3, 0, 20, 1], 48, 384, extra_rows=2)
    got = reference(q, s, w, ws, offs)
    assert got.dtype == torch.bfloat16 and got.shape == (26, 48)
    a = q.float() * s.repeat_interleave(128, 1)
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 23), (23, 24)]):
        want = F.linear(a[lo:hi], dequant_fp8_blocks(w[e], ws[e], (1, 128)))
        torch.testing.assert_close(got[lo:hi].float(), want, atol=0, rtol=2 ** -8)
    assert not got[24:].any()
    w8a16 = grouped_gemm.reference(x, w, offs, ws, (1, 128))
    assert rel_err(got[:24], w8a16[:24]) < 0.04


def test_bad_arguments_name_the_field():
    x, q, s, w, ws, offs = make_case([3, 2], 48, 256)
    with pytest.raises(ValueError, match="w_scale"):
        reference(q, s, w, ws[:, :, :1], offs)
    with pytest.raises(ValueError, match="a_scale"):
        reference(q, s[:, :1], w, ws, offs)
    with pytest.raises(ValueError, match="offs"):
        reference(q, s, w, ws, offs[:1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        reference(x, s, w, ws, offs)
    assert torch.equal(grouped_gemm_fp8(q, s, w, ws, offs), reference(q, s, w, ws, offs))  # CPU: the reference


# Ragged expert offsets (empty experts first, between and last, one-row experts, a tile-spanning one),
# rows past offs[-1] (the kernel leaves them unwritten: only rows < offs[-1] are compared), ragged N and
# K (a last activation group of 64 columns), (1, 128) E8M0 and (128, 128) fp32 weight scales, K steps of
# 64 and 128, act_quant's column-major scales and row-major ones.
CHECK = (
    "import torch\n"
    "from deepinfer.kernels.grouped_gemm_fp8 import _launch, reference\n"
    "from test_grouped_gemm_fp8 import make_case, rel_err\n"
    "cases = [([0, 1, 37, 0, 5, 0], 40, 256, (1, 128), 'e8m0', 3, dict(TILES, BLOCK_K=64)),\n"
    "         ([2, 0, 19], 40, 320, (128, 128), 'fp32', 0, TILES),\n"
    "         ([0, 0, 0], 16, 128, (1, 128), 'e8m0', 4, TILES),\n"
    "         ([17], 24, 128, (1, 128), 'e8m0', 0, TILES)] + EXTRA\n"
    "for counts, N, K, block, sd, extra, tiles in cases:\n"
    "    x, q, s, w, ws, offs = make_case(counts, N, K, block, sd, extra)\n"
    "    want = reference(q, s, w, ws, offs, 128, block)\n"
    "    n = sum(counts)\n"
    "    for sa in (s, s.contiguous()):\n"
    "        got = _launch(q.to(DEV), sa.to(DEV), w.to(DEV), ws.to(DEV), offs.to(DEV), 128, block, **tiles).cpu()\n"
    "        assert got.shape == (n + extra, N) and got.dtype == torch.bfloat16\n"
    "        torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=2e-2, rtol=1.6e-2)\n"
    "        assert n == 0 or rel_err(got[:n], want[:n]) < REL, (counts, N, K)\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(
    CHECK, "DEV = 'cpu'\nREL = 8e-3\nEXTRA = []\nTILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=1, "
    "num_stages=1)\n",
    "DEV = 'cuda'\nREL = 4e-3\nTILES = {}\n"
    "EXTRA = [([300, 0, 500, 129, 1] * 4, 2048, 4096, (1, 128), 'e8m0', 7, {}),\n"   # 128-row tiles
    "         ([64, 0, 70, 3] * 8, 4096, 2048, (1, 128), 'e8m0', 0, {}),\n"        # 64-row tiles
    "         ([200, 0, 90], 2048, 4096, (128, 128), 'e8m0', 0, {})]\n")

# The opt-in "tma" variant on the same cases (tensor descriptors: whole tiles read across expert ends and
# zero-filled past M / E * N / K, stores masked), one-program-per-tile and persistent grids (3 programs:
# each takes several tiles, some programs meet the end of the tile list at once).
test_tma_variant_in_the_triton_interpreter, test_tma_variant_on_gpu = interpreted_and_gpu(
    CHECK, "DEV = 'cpu'\nREL = 8e-3\nTILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1, "
    "variant='tma')\nEXTRA = [([0, 1, 37, 0, 5, 0], 40, 256, (1, 128), 'e8m0', 3, dict(TILES, programs=3)),\n"
    "         ([2, 0, 19], 40, 320, (128, 128), 'fp32', 0, dict(TILES, programs=2))]\n",
    "DEV = 'cuda'\nREL = 4e-3\nTILES = dict(variant='tma')\n"
    "EXTRA = [([300, 0, 500, 129, 1] * 4, 2048, 4096, (1, 128), 'e8m0', 7, TILES),\n"
    "         ([64, 0, 70, 3] * 8, 4096, 2048, (1, 128), 'e8m0', 0, dict(TILES, programs=132)),\n"
    "         ([200, 0, 90], 2048, 4096, (128, 128), 'e8m0', 0, dict(TILES, programs=7))]\n")


def test_tile_choices_are_checked():
    pytest.importorskip("triton")
    from deepinfer.kernels.grouped_gemm_fp8 import _launch
    x, q, s, w, ws, offs = make_case([3, 2], 48, 256)
    with pytest.raises(ValueError, match="BLOCK_K"):
        _launch(q, s, w, ws, offs, BLOCK_K=256)           # two activation groups in one K step
    x, q, s, w, ws, offs = make_case([3, 2], 48, 256, block=(1, 32))
    with pytest.raises(ValueError, match="BLOCK_K"):
        _launch(q, s, w, ws, offs, 128, (1, 32))        # weight scale blocks narrower than the K step
    x, q, s, w, ws, offs = make_case([3, 2], 48, 256)
    with pytest.raises(ValueError, match="variant"):
        _launch(q, s, w, ws, offs, variant="tmaa")
    with pytest.raises(ValueError, match="programs"):
        _launch(q, s, w, ws, offs, programs=4)          # a persistent grid is variant "tma"'s
    with pytest.raises(ValueError, match="experts contiguous"):
        _launch(q, s, torch.cat([w, w], 1)[:, :48], ws, offs, variant="tma")  # W [E, N, K] not [E * N, K]


def test_expert_launches_compile_for_sm90():
    """V4-Flash's routed experts at prefill sizes (8192 tokens x top-6, and ~2.7k tokens; default_config's 64-row tiles):
    w1/w3 N=2048 K=4096 and w2 N=4096 K=2048, folded (1, 128) E8M0 and (128, 128) scales; and the folded
    weights' W8A16 decode launches (grouped_gemm, one scale per K tile)."""
    pytest.importorskip("triton")
    from sm90 import compile_sm90, record
    from deepinfer.kernels import grouped_gemm_fp8 as g8

    E4, E = torch.float8_e4m3fn, 256
    with record() as got:
        for M in (8192 * 6, 2731 * 6):
            for N, K in ((2048, 4096), (4096, 2048)):
                a, sa = torch.empty(M, K, dtype=E4), torch.empty(K // 128, M).t()
                offs = torch.zeros(E, dtype=torch.int32)
                g8._launch(a, sa, torch.empty(E, N, K, dtype=E4), offs=offs,
                           w_scale=torch.zeros(E, N, K // 128, dtype=torch.uint8).view(torch.float8_e8m0fnu))
                g8._launch(a, sa, torch.empty(E, N, K, dtype=E4), torch.empty(E, N // 128, K // 128), offs,
                           128, (128, 128))
    assert {(launch.constexprs["BLOCK_M"], launch.options["num_warps"]) for launch in got} == {(64, 4)}
    with record() as decode:  # the same folded weights below the W8A8 threshold: W8A16 with (1, 128) blocks
        for M in (1, 6, 384):
            a, offs = torch.empty(M, 4096, dtype=torch.bfloat16), torch.zeros(E, dtype=torch.int32)
            w, ws = torch.empty(E, 2048, 4096, dtype=E4), torch.zeros(E, 2048, 32, dtype=torch.uint8)
            grouped_gemm._launch(a, w, offs, ws, (1, 128))
            grouped_gemm._launch(a, w, offs, ws, (1, 128), split_k=2)
    assert decode and all(launch.constexprs["BI"] % launch.constexprs["BLOCK_K"] == 0 for launch in decode)
    got += decode
    seen = {launch.key: launch for launch in got}
    for launch in seen.values():
        compile_sm90(launch)


def test_sm90_resources_of_the_expert_tiles(monkeypatch):
    """benchmarks/sm90_kernel_resources.py on three builds for sm_90 at V4's w1 shape (no GPU): default_config's
    tiles pipeline num_stages A + W buffers through shared memory without spilling; 128 x 128 x 128 tiles on
    4 warps spill (two fp32 128 x 128 accumulators in 128 threads); the "tma" variant's loads are TMA copies."""
    pytest.importorskip("triton")
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_kernel_resources import resources
    from deepinfer.kernels.grouped_gemm_fp8 import default_config

    cfg = default_config(49152, 256)
    base = resources("pointer", cfg)
    stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"]  # e4m3 bytes of one A and one W tile
    assert base["spill_stores"] == 0 and base["async_copies"] > 0 and base["tma_copies"] == 0
    assert base["shared"] >= cfg["num_stages"] * stage and base["ctas_per_sm"] >= 1 and base["fits"]
    assert 0 < base["registers"] <= 255
    wide = resources("pointer", dict(cfg, BLOCK_M=128))
    assert wide["spill_stores"] > 0 and wide["spill_loads"] > 0
    tma = resources("tma", cfg)
    assert tma["tma_copies"] > 0 and tma["async_copies"] == 0 and tma["spill_stores"] == 0


# ---------------------------------------------------------------- GPU only

VARIANTS = [{}, dict(variant="tma"), dict(variant="tma", programs=264)]  # default, opt-in TMA, persistent


@pytest.mark.gpu
@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("N,K", [(2048, 4096), (4096, 2048)])
def test_prefill_shape_matches_the_reference_on_gpu(N, K, kw):
    """256 experts, ~192 rows each on average (8192 tokens x top-6), some empty."""
    from deepinfer.kernels.act_quant import act_quant as act_quant_gpu
    torch.manual_seed(N)
    with torch.device("cuda"):
        prob = torch.rand(256) ** 3
        prob[::37] = 0  # experts 0, 37, ... get no row
        pick = torch.multinomial(prob, 49152, replacement=True)
        offs = torch.bincount(pick, minlength=256).cumsum(0).to(torch.int32)
        q, s = act_quant_gpu(torch.randn(49152, K, dtype=torch.bfloat16))
        w = (torch.randn(256, N, K) * 4).to(torch.float8_e4m3fn)
        ws = torch.randint(119, 125, (256, N, K // 128), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = grouped_gemm_fp8(q, s, w, ws, offs, **kw)
    want = reference(q, s, w, ws, offs)
    assert rel_err(got, want) < 4e-3
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", VARIANTS)
def test_replays_in_a_cuda_graph_with_new_offsets(kw):
    x, q, s, w, ws, offs = make_case([300, 0, 500, 224], 1024, 2048, device="cuda")
    grouped_gemm_fp8(q, s, w, ws, offs, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm_fp8(q, s, w, ws, offs, **kw)
    for counts in ([1024, 0, 0, 0], [0, 0, 0, 1024], [100, 700, 24, 200]):
        offs.copy_(torch.tensor(counts, device="cuda").cumsum(0))
        graph.replay()
        assert rel_err(out, reference(q, s, w, ws, offs)) < 4e-3
