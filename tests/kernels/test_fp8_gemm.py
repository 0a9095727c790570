"""FP8 x FP8 block-scaled GEMM (kernels/fp8_gemm.py): the reference's math, the Triton kernel against
it (interpreter on the CPU, compiled on the GPU), torch._scaled_mm's blockwise path on the GPU.

GPU tolerances: the kernels and `reference` multiply the same e4m3 operands (products exact in fp32)
and differ only in fp32 summation order and where the per-block scales are applied, so results agree
to bf16 output rounding: relative Frobenius error < 4e-3 and elementwise atol 2e-2 + rtol 1.6e-2."""
import pytest
import torch
import torch.nn.functional as F

from deepinfer.formats.quant import dequant_fp8_blocks
from deepinfer.kernels import grouped_gemm
from deepinfer.kernels.act_quant import reference as act_quant
from deepinfer.kernels.fp8_gemm import fp8_gemm, reference, scaled_mm_shape_ok, use_scaled_mm
from interpreter import interpreted_and_gpu


def make_case(M, N, K, block=(128, 128), group=128, scale_dtype="e8m0", seed=0, device="cpu"):
    """bf16 activations quantised by act_quant's reference, an e4m3 weight using every code range,
    E8M0 block scales 2^-7 .. 2^-3 (or fp32 ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q, s = act_quant(x, group)
    w = (torch.randn(N, K, generator=g) * 4).to(torch.float8_e4m3fn)
    shape = (-(-N // block[0]), -(-K // block[1]))
    ws = torch.randint(120, 125, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    if scale_dtype == "fp32":
        ws = torch.rand(shape, generator=g) * 0.03 + 0.002
    move = lambda t: t.to(device)  # noqa: E731
    return x.to(device), move(q), move(s), move(w), move(ws)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def test_reference_is_the_dequantised_product():
    """W8A8 = W8A16 on the dequantised activations: act_quant's q * s fed to the W8A16 reference
    gives the same product (both fp32 over exact operands), and it is close to x @ W itself."""
    x, q, s, w, ws = make_case(21, 200, 384)
    got = reference(q, s, w, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (21, 200)
    a = (q.float() * s.repeat_interleave(128, 1)).to(torch.float32)
    want = F.linear(a, dequant_fp8_blocks(w, ws, (128, 128)))
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2 ** -8)
    exact = grouped_gemm.reference(x, w, None, ws, (128, 128))         # W8A16: bf16 activations
    assert rel_err(got, exact) < 0.04                                  # e4m3 activations: ~2^-5 relative


def test_shapes_for_scaled_mm_and_cpu_dispatch():
    assert scaled_mm_shape_ok(1536, 4096, 128, (128, 128))
    assert not scaled_mm_shape_ok(1536, 4096, 128, (32, 32))            # V4.1 blocks: Triton
    assert not scaled_mm_shape_ok(1536, 4096, 32, (128, 128))           # not the 1x128 recipe
    assert not scaled_mm_shape_ok(1536, 384, 128, (128, 128))           # K / 128 = 3: stride rules differ
    assert not scaled_mm_shape_ok(1040, 4096, 128, (128, 128))          # a ragged weight block
    assert not use_scaled_mm(torch.device("cpu"), 1536, 4096, 128, (128, 128))
    x, q, s, w, ws = make_case(5, 64, 256)
    assert torch.equal(fp8_gemm(q, s, w, ws), reference(q, s, w, ws))  # CPU tensors: the reference


def test_bad_arguments_name_the_field():
    x, q, s, w, ws = make_case(5, 64, 256)
    with pytest.raises(ValueError, match="w_scale"):
        reference(q, s, w, ws[:, :1])
    with pytest.raises(ValueError, match="a_scale"):
        reference(q, s[:, :1], w, ws)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        reference(x, s, w, ws)
    with pytest.raises(ValueError, match="powers of two"):
        reference(q, s, w, ws, 128, (96, 128))


# The kernel against the reference: 128-blocks (the scale once per K step), V4.1's 32 x 32 (a K step of
# 32), 1 x 32 activation groups with odd weight blocks, fp32 scales, ragged M / N / K, column slices of a
# wider A (forward_grouped's per-group GEMMs), padded activation rows. The interpreter casts fp32 to bf16
# by truncation (compiled kernels round to nearest), hence its looser relative bound.
CHECK = (
    "import torch\n"
    "from deepinfer.kernels.act_quant import reference as aq\n"
    "from deepinfer.kernels.fp8_gemm import _launch, reference\n"
    "from test_fp8_gemm import make_case, rel_err\n"
    "cases = [(37, 40, 256, (128, 128), 128, 'e8m0'), (21, 50, 96, (32, 32), 128, 'fp32'),\n"
    "         (5, 64, 160, (16, 64), 32, 'e8m0'), (40, 160, 384, (32, 32), 128, 'e8m0')] + EXTRA\n"
    "for M, N, K, block, group, sd in cases:\n"
    "    x, q, s, w, ws = make_case(M, N, K, block, group, sd)\n"
    "    want = reference(q, s, w, ws, group, block)\n"
    "    got = _launch(q.to(DEV), s.to(DEV), w.to(DEV), ws.to(DEV), group, block, **TILES).cpu()\n"
    "    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)\n"
    "    assert rel_err(got, want) < REL, (M, N, K, block)\n"
    "x, q, s, w, ws = make_case(19, 64, 512)\n"
    "q2, s2 = aq(x, 128, rows=32)\n"  # padded rows; the right half of A as a strided slice
    "want = reference(q2[:19, 256:], s2[:19, 2:], w[:, 256:], ws[:, 2:])\n"
    "got = _launch(q2[:, 256:].to(DEV), s2[:, 2:].to(DEV), w[:, 256:].to(DEV), ws[:, 2:].to(DEV), **TILES)\n"
    "torch.testing.assert_close(got[:19].cpu().float(), want.float(), atol=2e-2, rtol=1.6e-2)\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(
    CHECK, "DEV = 'cpu'\nREL = 8e-3\nEXTRA = []\nTILES = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)\n",
    "DEV = 'cuda'\nREL = 4e-3\nEXTRA = [(300, 1536, 4096, (128, 128), 128, 'e8m0'), (257, 1280, 5120, (32, 32), 128, 'e8m0')]\n"
    "TILES = {}\n")


# ---------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_scaled_mm_blockwise_is_available_on_the_gpu(monkeypatch):
    """torch._scaled_mm's blockwise recipe runs on this device (else W8A8 falls back to Triton: slower),
    also when first probed under inference mode, as the engine probes it (an inference tensor in the probe
    once made it read as unavailable: FP8 prefill linears silently ran the 2x slower Triton GEMM)."""
    from deepinfer.kernels import fp8_gemm

    assert use_scaled_mm(torch.device("cuda"), 1536, 4096, 128, (128, 128))
    monkeypatch.setattr(fp8_gemm, "_SCALED_MM_OK", {})
    with torch.inference_mode():
        assert use_scaled_mm(torch.device("cuda"), 1536, 4096, 128, (128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "scaled_mm", "triton"])
@pytest.mark.parametrize("M,N,K", [(256, 1536, 4096), (8192, 4096, 2048), (4000, 32768, 1024), (16, 4096, 8192)])
def test_backends_match_the_reference_on_gpu(backend, M, N, K):
    x, q, s, w, ws = make_case(M, N, K, device="cuda", seed=M)
    want = reference(q, s, w, ws)
    got = fp8_gemm(q, s, w, ws, 128, (128, 128), backend)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 4e-3
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_fp8_gemm_replays_in_a_cuda_graph():
    x, q, s, w, ws = make_case(512, 1536, 4096, device="cuda")
    fp8_gemm(q, s, w, ws)  # probe and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(q, s, w, ws)
    x2, q2, s2 = make_case(512, 1536, 4096, device="cuda", seed=5)[:3]
    q.copy_(q2), s.copy_(s2)
    graph.replay()
    assert rel_err(out, reference(q, s, w, ws)) < 4e-3
