"""Which W8A8 expert GEMM variant the MoE layer may run: tma_variant_ok accepts exactly what the TMA
launcher takes (whole expert tensors) and refuses what it would reject (EP slices with gaps, misaligned
rows), so the layer never raises mid-step."""
import pytest
import torch

gg8 = pytest.importorskip("deepinfer.kernels.grouped_gemm_fp8")
if gg8.TensorDescriptor is None:
    pytest.skip("this Triton has no host tensor descriptors", allow_module_level=True)


def _ops(E=4, N=64, K=256, M=8):
    a = torch.zeros(M, K, dtype=torch.float8_e4m3fn)
    w = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
    return a, w


def test_whole_tensors_take_tma():
    a, w = _ops()
    assert gg8.tma_variant_ok(a, w)
    assert gg8.tma_variant_ok(a, w[1:3])  # a run of whole experts is still one [E * N, K] view


def test_refused_layouts():
    a, w = _ops()
    assert not gg8.tma_variant_ok(a, w[:, :32])            # experts not contiguous (rows sliced)
    assert not gg8.tma_variant_ok(a, w[::2])               # every other expert
    a200, w200 = _ops(K=200)
    assert not gg8.tma_variant_ok(a200, w200)            # rows of 200 bytes: strides not 16-byte aligned
    assert gg8.tma_variant_ok(a[:, :200], w[..., :200])    # K 200 inside 256-byte rows: aligned strides
    assert not gg8.tma_variant_ok(a.t().contiguous().t(), w)  # A not unit stride along K
    wide = torch.zeros(4 * 64 * 256 + 1, dtype=torch.float8_e4m3fn)[1:].view(4, 64, 256)
    assert not gg8.tma_variant_ok(a, wide)                 # base not 16-byte aligned

