"""Variant "gluon" of the grouped FP8 GEMM (kernels/grouped_gemm_fp8_gluon.py).

On the CPU: the kernels (the default and the warp-specialised one, ws=True) built ahead of time for sm_90 at V4's
routed-expert shapes, and what their PTX shows (async wgmma, `wgmma.wait_group 1` inside the K loops, no spills,
no wgmma serialisation by ptxas, shared memory within the H200's limit; ws: a producer partition and two consumer
K loops, registers reallocated between them); the refusals. On the GPU: against `reference` on ragged expert offsets and
in a CUDA graph with new offsets.

Gluon has no interpreter in Triton 3.6, so the values are checked on the GPU only."""
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
ggl = pytest.importorskip("deepinfer.kernels.grouped_gemm_fp8_gluon")
if not ggl.available():
    pytest.skip("this Triton has no Gluon", allow_module_level=True)

from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon._runtime import GluonJITFunction  # noqa: E402

import sm90  # noqa: E402
from test_grouped_gemm_fp8 import make_case, rel_err  # noqa: E402

from deepinfer.kernels import grouped_gemm_fp8 as g8  # noqa: E402
from deepinfer.kernels.grouped_gemm import max_m_tiles  # noqa: E402

SM90_MAX_SHARED = ggl.SM90_MAX_SHARED  # dynamic shared memory one block may take on H100 / H200
E4 = torch.float8_e4m3fn
SHAPES = {"w1": (2048, 4096), "w2": (4096, 2048)}  # V4's routed experts: w1 / w3 and w2 (N, K)
EXPERTS, ROWS = 256, 8192 * 6                      # 8192 tokens x top-6


def _recorded(**kw):
    """The Gluon launch grouped_gemm_fp8._launch(variant="gluon") makes for `kw`, recorded, not run:
    (kernel, {parameter: value, launch option: value, "grid": grid})."""
    got = []

    def fake(self, *args, grid, warmup, **kwargs):
        got.append((self, {**dict(zip(self.arg_names, args)), **kwargs, "grid": grid}))
    own = GluonJITFunction.__dict__.get("run")  # None: inherited from JITFunction, which sm90.record patches
    GluonJITFunction.run = fake
    try:
        g8._launch(**kw, variant="gluon")
    finally:
        if own is None:
            del GluonJITFunction.run
        else:
            GluonJITFunction.run = own
    (fn, bound), = got
    return fn, bound  # bound["grid"]: the launch grid


def _expert_launch(shape="w1", scales="e8m0", **tiles):
    N, K = SHAPES[shape]
    if scales == "e8m0":  # V4's FP4 experts as FP8 codes with folded (1, 128) E8M0 scales
        ws, block = torch.zeros(EXPERTS, N, K // 128, dtype=torch.uint8).view(torch.float8_e8m0fnu), (1, 128)
    else:                 # an FP8 checkpoint's (128, 128) fp32 block scales
        ws, block = torch.zeros(EXPERTS, N // 128, K // 128), (128, 128)
    return _recorded(a=torch.empty(ROWS, K, dtype=E4), a_scale=torch.empty(K // 128, ROWS).t(),  # act_quant's layout
                     w=torch.empty(EXPERTS, N, K, dtype=E4), w_scale=ws,
                     offs=torch.zeros(EXPERTS, dtype=torch.int32), group=128, block=block, **tiles)


def compile_sm90(fn, bound):
    """The kernel as the JIT would build it on an H200 for these argument values (CPU tensors stand for
    device ones: 16-byte aligned): tests/kernels/sm90.py's specialisation and Gluon build."""
    return sm90.compile_sm90(sm90.launch_of(fn, {}, {k: v for k, v in bound.items() if k != "grid"}), specialize=True)


def ptxas_log(ptx: str) -> str:
    """`ptxas -v` on the PTX for sm_90a (its info lines: registers, spills, wgmma serialisation C7514)."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        return subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                              capture_output=True, text=True, check=True).stderr


def loop_bodies(ptx: str) -> list[str]:
    """The PTX of each innermost loop: from a block LLVM marks as an inner loop header (at any depth: a
    warp-specialised worker's loops sit inside its partition's dispatch loop) to the branch back to it."""
    bodies = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):(?:\s*//[^\n]*Parent Loop[^\n]*)*\s*// =>\s*This Inner Loop Header",
                         ptx, re.M):
        end = re.search(rf"bra(?:\.uni)?\s+{re.escape(m.group(1))};", ptx[m.end():])
        assert end is not None, f"no back edge to {m.group(1)}"
        bodies.append(ptx[m.start():m.end() + end.end()])
    return bodies


def k_loop_waits(ptx: str) -> list[list[int]]:
    """wgmma.wait_group counts inside each loop that issues wgmma (the K loops)."""
    return [[int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", body)]
            for body in loop_bodies(ptx) if "wgmma.mma_async" in body]


# ---------------------------------------------------------------- CPU: sm_90 builds


@pytest.mark.parametrize("shape,scales", [("w1", "e8m0"), ("w2", "e8m0"), ("w1", "fp32")])
def test_sm90_build_keeps_an_mma_in_flight_while_promoting(shape, scales):
    """V4's expert shapes with the default tiles: the K loop waits with one wgmma group outstanding, ptxas
    keeps the wgmma asynchronous (no C7514 serialisation), no spills, shared memory fits an H200 block."""
    kernel = compile_sm90(*_expert_launch(shape, scales))
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    (waits,) = k_loop_waits(ptx)
    assert 1 in waits, f"K loop waits {waits}: every MMA completes before its product is promoted"
    log = ptxas_log(ptx)
    assert "C7514" not in log and "serialized" not in log, log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 255
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log
    assert 4 * (64 + 128) * 128 <= kernel.metadata.shared  # 4 stages of 64 x 128 A and 128 x 128 W tiles
    assert 2 * (kernel.metadata.shared + 1024) <= 228 * 1024  # two CTAs an SM
    assert kernel.asm["ttgir"].count("ttng.async_tma_copy_global_to_local") > 0


def test_the_checks_tell_overlap_from_none():
    """group_steps=1 is the no-overlap baseline: every K step's MMA is waited to zero in the loop, so the
    PTX checks above would fail on it."""
    ptx = compile_sm90(*_expert_launch("w2", group_steps=1)).asm["ptx"]
    (waits,) = k_loop_waits(ptx)
    assert waits == [0]


def test_larger_tiles_build_for_sm90():
    """128-row tiles of two warpgroups (8 warps): no spills, no wgmma serialisation, within one block's shared
    memory."""
    kernel = compile_sm90(*_expert_launch("w1", BLOCK_M=128, num_warps=8))
    log = ptxas_log(kernel.asm["ptx"])
    assert "C7514" not in log and re.search(r"\b0 bytes spill stores", log), log
    assert kernel.metadata.shared <= SM90_MAX_SHARED


@pytest.mark.parametrize("shape,scales", [("w1", "e8m0"), ("w2", "e8m0"), ("w1", "fp32")])
def test_ws_sm90_build_has_a_producer_and_two_consumers(shape, scales):
    """ws=True at V4's expert shapes: a warp-specialised region of the default partition (consumer 0) and two
    workers (consumer 1: 4 warps, the producer: 1 warp) with registers reallocated (setmaxnreg 232 / 40); each
    consumer's K loop keeps one wgmma group in flight while promoting and releases slots by mbarrier arrivals;
    ptxas keeps the wgmma asynchronous (no C7514), no spills; 2 x 64-row A and 128-row W tiles in 4 slots, the
    whole within one H200 block's shared memory and _ws_shared's bound."""
    fn, bound = _expert_launch(shape, scales, ws=True)
    assert bound["WS"] is True
    assert bound["a_desc"].block_shape == [128, 128] and bound["w_desc"].block_shape == [128, 128]
    kernel = compile_sm90(fn, bound)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert ttgir.count("ttg.warp_specialize(") == 1
    assert "requestedRegisters = array<i32: 232, 40>" in ttgir
    assert re.search(r"partition0\(.*\) num_warps\(4\)", ttgir) and re.search(r"partition1\(.*\) num_warps\(1\)", ttgir)
    assert ".reqntid 384" in ptx  # three warpgroups: consumer 0, consumer 1, the producer's (1 warp working)
    assert "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t40" in ptx
    consumers = [body for body in loop_bodies(ptx) if "wgmma.mma_async" in body]
    assert len(consumers) == 2, f"{len(consumers)} K loops issue wgmma"
    for body in consumers:
        waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", body)]
        assert waits == [1, 1, 0], waits  # groups of 3: two of three promotions beside an MMA
        assert "mbarrier.arrive" in body and "mbarrier.try_wait" in body  # releases slots, waits for data / turns
    log = ptxas_log(ptx)
    assert "C7514" not in log and "serialized" not in log, log
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log
    assert 4 * (128 + 128) * 128 <= kernel.metadata.shared <= ggl._ws_shared({**ggl.default_config(), "ws": True})
    assert kernel.metadata.shared <= SM90_MAX_SHARED
    assert ttgir.count("ttng.async_tma_copy_global_to_local") == 2  # in the producer only: A and W of a step


@pytest.mark.parametrize("tiles", [dict(num_stages=6), dict(group_steps=1), dict(BLOCK_N=64, num_stages=8)])
def test_ws_variants_build_for_sm90(tiles):
    """The ws tiles fp8_gemm_bench times: within _ws_shared's bound and one block's shared memory, no spills,
    wgmma kept asynchronous; group_steps=1 waits every MMA to zero in both consumers (the no-overlap baseline)."""
    cfg = {**ggl.default_config(), "ws": True, **tiles}
    kernel = compile_sm90(*_expert_launch("w1", ws=True, **tiles))
    assert kernel.metadata.shared <= ggl._ws_shared(cfg) <= SM90_MAX_SHARED
    log = ptxas_log(kernel.asm["ptx"])
    assert "C7514" not in log and re.search(r"\b0 bytes spill stores", log), log
    if cfg["group_steps"] == 1:
        assert k_loop_waits(kernel.asm["ptx"]) == [[0], [0]]


def test_ws_persistent_builds_for_sm90():
    """persistent=True: one program an SM (132 on a launch recorded without a device) over the bound on 128-row
    tiles x 16 column tiles; every partition loops over its tiles (the loads, both consumers' K loops inside a tile
    loop), no wgmma serialisation; no spills at group_steps 1; at the default group_steps 3 a few per-tile scalars
    spill (ptxas: 56 bytes), what the bench rows measure."""
    fn, bound = _expert_launch("w1", ws=True, persistent=True)
    assert bound["PERSISTENT"] is True and bound["grid"] == (ggl.SM90_SMS,)
    assert bound["all_tiles"] == max_m_tiles(ROWS, EXPERTS, 128) * 2048 // 128
    fn_one, bound_one = _expert_launch("w1", ws=True)
    assert bound_one["grid"] == (bound["all_tiles"],) and bound_one["PERSISTENT"] is False
    kernel = compile_sm90(fn, bound)
    ptx = kernel.asm["ptx"]
    consumers = [body for body in loop_bodies(ptx) if "wgmma.mma_async" in body]
    assert len(consumers) == 2 and all("Parent Loop" in body.split("\n", 1)[0] for body in consumers)
    producer = kernel.asm["ttgir"].split("partition1(", 1)[1]
    assert producer.count("scf.for") >= 2 and "ttng.async_tma_copy_global_to_local" in producer  # tiles, steps
    log = ptxas_log(ptx)
    assert "C7514" not in log, log
    assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= 64, log
    log = ptxas_log(compile_sm90(*_expert_launch("w1", ws=True, persistent=True, group_steps=1)).asm["ptx"])
    assert "C7514" not in log and re.search(r"\b0 bytes spill stores", log), log


# ---------------------------------------------------------------- CPU: refusals


def _case():
    return make_case([3, 0, 5], 256, 512)[1:]  # q, s, w, ws, offs


def test_refusals_name_the_field(monkeypatch):
    q, s, w, ws, offs = _case()
    run = lambda **kw: g8._launch(**{**dict(a=q, a_scale=s, w=w, w_scale=ws, offs=offs), **kw},  # noqa: E731
                                  variant="gluon")
    with pytest.raises(ValueError, match="num_warps"):
        run(BLOCK_M=128, num_warps=4)
    with pytest.raises(ValueError, match="BLOCK_N"):
        run(BLOCK_N=96)
    with pytest.raises(ValueError, match="BLOCK_K"):
        run(BLOCK_K=64)
    with pytest.raises(ValueError, match="num_stages"):
        run(num_stages=1)
    with pytest.raises(ValueError, match="group_steps"):
        run(group_steps=0)
    with pytest.raises(ValueError, match="split_k"):
        run(split_k=2)
    with pytest.raises(ValueError, match="programs"):
        run(programs=132)
    with pytest.raises(ValueError, match="ws True or False"):
        run(ws="yes")
    with pytest.raises(ValueError, match=r"ws=True .*num_warps 8"):
        run(ws=True, BLOCK_M=128, num_warps=8)
    with pytest.raises(ValueError, match=r"ws=True .*BLOCK_N 256"):
        run(ws=True, BLOCK_N=256)
    with pytest.raises(ValueError, match=r"ws=True .*num_stages 7"):
        run(ws=True, num_stages=7)
    with pytest.raises(ValueError, match="ws=True for persistent=True"):
        run(persistent=True)
    with pytest.raises(ValueError, match="persistent True or False"):
        run(ws=True, persistent=1.5)
    with pytest.raises(ValueError, match="a_scale"):
        run(a_scale=s.to(torch.bfloat16))
    with pytest.raises(ValueError, match="offs"):
        run(offs=offs.long())
    with pytest.raises(ValueError, match="experts contiguous"):
        run(w=torch.zeros(3, 512, 512, dtype=E4)[:, :256], w_scale=ws)
    with pytest.raises(ValueError, match=r"group \(64\)"):
        run(a_scale=torch.ones(q.shape[0], 8), group=64)
    with pytest.raises(ValueError, match="unit stride"):
        run(a=q.t().contiguous().t())
    with pytest.raises(ValueError, match="variant 'pointer' only"):  # packed FP4 weights
        run(w=torch.zeros(3, 256, 256, dtype=torch.uint8),
            w_scale=torch.zeros(3, 256, 16, dtype=torch.uint8), block=(1, 32))
    monkeypatch.setattr(ggl, "gluon", None)
    with pytest.raises(ValueError, match="needs triton.experimental.gluon"):
        run()


# ---------------------------------------------------------------- GPU only

GPU_TILES = [{}, dict(BLOCK_M=64, num_warps=4), dict(group_steps=1), dict(group_steps=2), dict(group_steps=4),
             dict(num_stages=3), dict(ws=True), dict(ws=True, group_steps=1), dict(ws=True, num_stages=6),
             dict(ws=True, BLOCK_N=64, num_stages=8), dict(ws=True, persistent=True),
             dict(ws=True, persistent=True, group_steps=1)]
WS = [dict(), dict(ws=True), dict(ws=True, persistent=True)]  # the default kernel and the warp-specialised ones


def tiles_id(tiles: dict) -> str:
    """A test id from tile options: "default", "ws-group_steps1", ... (so that `-k ws` picks the ws kernels)."""
    return "-".join(k if v is True else f"{k}{v}" for k, v in tiles.items()) or "default"


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", GPU_TILES, ids=tiles_id)
@pytest.mark.parametrize("N,K", [(2048, 4096), (4096, 2048)])
def test_prefill_shape_matches_the_reference_on_gpu(N, K, tiles):
    """256 experts, ~192 rows each on average (8192 tokens x top-6), every 37th empty, skewed counts (experts
    spanning many 128-row tiles); tolerances of the "tma" variant's GPU test."""
    from deepinfer.kernels.act_quant import act_quant as act_quant_gpu
    torch.manual_seed(N)
    with torch.device("cuda"):
        prob = torch.rand(256) ** 3
        prob[::37] = 0
        pick = torch.multinomial(prob, 49152, replacement=True)
        offs = torch.bincount(pick, minlength=256).cumsum(0).to(torch.int32)
        q, s = act_quant_gpu(torch.randn(49152, K, dtype=torch.bfloat16))
        w = (torch.randn(256, N, K) * 4).to(E4)
        ws = torch.randint(119, 125, (256, N, K // 128), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert int(torch.diff(offs, prepend=offs[:1] * 0).max()) > 4 * 128
    got = g8.grouped_gemm_fp8(q, s, w, ws, offs, variant="gluon", **tiles)
    want = g8.reference(q, s, w, ws, offs)
    assert rel_err(got, want) < 4e-3
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", WS, ids=tiles_id)
@pytest.mark.parametrize("counts,N,K,block,scales", [
    ([300, 0, 500, 224], 1024, 2048, (1, 128), "e8m0"),     # empty expert, tiles crossing experts' ends
    ([1, 0, 129, 0, 7], 384, 640, (128, 128), "fp32"),      # fp32 (128, 128) blocks; K 640: 5 steps (odd)
    ([64, 3], 200, 384, (1, 128), "e8m0"),                  # N not a multiple of BLOCK_N
])
def test_ragged_cases_match_the_reference_on_gpu(counts, N, K, block, scales, tiles):
    """ws: tiles whose second 64 rows lie past their expert's end (1, 7, 64 and 3 rows; consumer 1 only releases the
    slots) beside tiles of two live halves."""
    _, q, s, w, ws, offs = make_case(counts, N, K, block=block, scale_dtype=scales, extra_rows=5, device="cuda")
    out = g8.grouped_gemm_fp8(q, s, w, ws, offs, block=block, variant="gluon", **tiles)
    want = g8.reference(q, s, w, ws, offs, block=block)
    n = sum(counts)
    assert rel_err(out[:n], want[:n]) < 4e-3
    torch.testing.assert_close(out[:n].float(), want[:n].float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", WS, ids=tiles_id)
def test_replays_in_a_cuda_graph_with_new_offsets(tiles):
    x, q, s, w, ws, offs = make_case([300, 0, 500, 224], 1024, 2048, device="cuda")
    g8.grouped_gemm_fp8(q, s, w, ws, offs, variant="gluon", **tiles)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g8.grouped_gemm_fp8(q, s, w, ws, offs, variant="gluon", **tiles)
    for counts in ([1024, 0, 0, 0], [0, 0, 0, 1024], [100, 700, 24, 200]):
        offs.copy_(torch.tensor(counts, device="cuda").cumsum(0))
        graph.replay()
        assert rel_err(out, g8.reference(q, s, w, ws, offs)) < 4e-3
