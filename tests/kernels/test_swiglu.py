import pytest
import torch

from deepinfer.kernels.swiglu import reference, swiglu
from deepinfer.layers.moe import clamped_swiglu
from interpreter import run_interpreted

LIMIT = 10.0


def _inputs(M: int, F: int, device: str, fused: bool = False):
    """bf16 gate / up with values well beyond +-LIMIT; `fused`: column halves of one [M, 2F] tensor."""
    g = torch.Generator(device=device).manual_seed(M * 7 + F)
    both = (torch.randn(M, 2 * F, generator=g, device=device) * 8).to(torch.bfloat16)
    if fused:
        return both[:, :F], both[:, F:]
    return both[:, :F].contiguous(), both[:, F:].contiguous()


def test_reference_is_the_layer_formula():
    gate, up = _inputs(37, 80, "cpu")
    assert torch.equal(reference(gate, up, LIMIT), clamped_swiglu(gate, up, LIMIT).to(torch.bfloat16))
    assert torch.equal(swiglu(gate, up, LIMIT, torch.float32), clamped_swiglu(gate, up, LIMIT))  # cpu: reference


@pytest.mark.gpu
@pytest.mark.parametrize("M,F", [(1, 2048), (37, 2048), (37, 80), (1, 80), (300, 1000)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_on_gpu(M, F, fused, out_dtype):
    gate, up = _inputs(M, F, "cuda", fused)
    assert gate.abs().max() > LIMIT and up.abs().max() > LIMIT
    got, want = swiglu(gate, up, LIMIT, out_dtype), reference(gate, up, LIMIT, out_dtype)
    assert got.shape == (M, F) and got.dtype == out_dtype and got.is_contiguous()
    if out_dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2 ** -7)  # <= 1 bf16 ulp
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_kernel_under_cuda_graph_capture():
    gate, up = _inputs(64, 2048, "cuda")
    swiglu(gate, up, LIMIT)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu(gate, up, LIMIT)
    gate.copy_(gate.flip(0))
    graph.replay()
    torch.testing.assert_close(out.float(), reference(gate, up, LIMIT).float(), atol=1e-5, rtol=2 ** -7)


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch, triton\n"
        "from deepinfer.kernels.swiglu import _swiglu_kernel, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "both = (torch.randn(5, 2 * 40, generator=g) * 8).to(torch.bfloat16)\n"
        "gate, up = both[:, :40], both[:, 40:]  # row stride 80\n"
        "for dt in (torch.bfloat16, torch.float32):\n"
        "    out = torch.empty(5, 40, dtype=dt)\n"
        "    _swiglu_kernel[(5, triton.cdiv(40, 16))](gate, up, out, 40, 80, 80, 10.0, BLOCK=16)\n"
        "    want = reference(gate, up, 10.0, dt)\n"
        "    torch.testing.assert_close(out.float(), want.float(), atol=1e-5, rtol=2 ** -7)\n"
        "print('ok')\n")
    run_interpreted(code)
