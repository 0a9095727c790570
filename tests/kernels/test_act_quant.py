"""Per-token 1 x group FP8 quantisation of activations (kernels/act_quant.py): the reference's rule,
the kernel bit-equal to it (interpreter on the CPU, compiled on the GPU)."""
import pytest
import torch

from deepinfer.formats import group_quant
from deepinfer.kernels.act_quant import act_quant, dequant, reference
from interpreter import interpreted_and_gpu


def _wide(M: int, K: int, seed: int = 0) -> torch.Tensor:
    """Rows from 1e-6 to 1e3 in magnitude; row 1 spans 2^-24 .. 2^4 (e4m3 subnormals after scaling);
    row 2 zero; row 3 exact ties between e4m3 codes once scaled."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-6, 3, M)[:, None]
    x[1] = torch.exp2(torch.linspace(-24, 4, K)) * torch.sign(torch.randn(K, generator=g))
    x[2] = 0
    ties = torch.tensor([68.0, 76.0, 84.0, 136.0, 152.0, 168.0, 232.0])  # midway between e4m3 codes
    x[3] = ties.repeat(-(-K // 7))[:K] * 2.0 ** -6                    # scale 2^-6: x / s = those ties
    return x.to(torch.bfloat16)


def test_group_rule_matches_the_fp8_cache_format():
    """Group 32 is formats/group_quant's fp8 (the reference's QAT rule): same codes, same scales."""
    x = _wide(9, 96)
    q, s = reference(x, 32)
    gq, ge = group_quant.encode(x, "fp8")
    assert torch.equal(q.view(torch.uint8), gq.view(torch.uint8))
    assert torch.equal(s, torch.exp2(ge.float() - 127))


def test_scales_and_codes_follow_the_rule():
    x = _wide(12, 300)
    for pow2 in (True, False):
        q, s = reference(x, 128, pow2)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (12, 300) and s.shape == (12, 3)
        assert s.stride() == (1, 12)                                   # column-major: cuBLAS's 1x128 layout
        amax = torch.zeros(12, 384)
        amax[:, :300] = x.float().abs()
        amax = amax.view(12, 3, 128).amax(-1).clamp_min(1e-4)
        if pow2:
            assert torch.equal(s, torch.exp2(torch.ceil(torch.log2(s))))  # powers of two
            assert (s >= amax / 448).all() and (s < amax / 224).all()
        else:
            torch.testing.assert_close(s, amax / 448, rtol=2e-7, atol=0)
        back = dequant(q, s)
        assert back.shape == (12, 300)
        err = (back - x.float()).abs()
        bound = torch.maximum(x.float().abs() * 2.0 ** -4, s.repeat_interleave(128, 1)[:, :300] * 2.0 ** -10)
        assert (err <= bound).all()                                    # e4m3: half an ulp (3 mantissa bits)
    q, s = reference(x, 128, rows=16)                                  # padded rows: zeros in the reference
    assert q.shape == (16, 300) and s.shape == (16, 3) and s.stride() == (1, 16)
    assert (q[12:].float() == 0).all()


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="group"):
        reference(torch.zeros(2, 64), 48)
    with pytest.raises(ValueError, match="x must be"):
        reference(torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match="rows"):
        reference(torch.zeros(4, 64), 32, rows=2)


def test_cpu_tensors_take_the_reference():
    x = _wide(5, 256)
    q, s = act_quant(x)
    qr, sr = reference(x)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


# The kernel against the reference, bit for bit: wide ranges, subnormal codes, ties, a zero row, ragged
# K, padded rows (not compared: the kernel leaves them unwritten), a column slice of a wider tensor.
CHECK = (
    "import torch\n"
    "from deepinfer.kernels.act_quant import _launch, reference\n"
    "from test_act_quant import _wide\n"
    "x = _wide(37, 640)\n"
    "for M, K, group, pow2, rows, sl in [(37, 300, 128, True, None, False), (37, 640, 32, True, 48, False),\n"
    "                                  (20, 256, 64, False, None, False), (37, 256, 128, True, 48, True),\n"
    "                                  (1, 128, 128, True, 16, False)]:\n"
    "    a = x[:M, 128:128 + K] if sl else x[:M, :K].contiguous()\n"
    "    q, s = _launch(a.to(DEV), group, pow2, rows)\n"
    "    qr, sr = reference(a, group, pow2, rows)\n"
    "    assert q.shape == qr.shape and s.shape == sr.shape and s.stride() == sr.stride()\n"
    "    assert torch.equal(s[:M].cpu(), sr[:M]), (M, K, group)\n"
    "    assert torch.equal(q[:M].cpu().view(torch.uint8), qr[:M].view(torch.uint8)), (M, K, group)\n"
    "print('ok')\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")
