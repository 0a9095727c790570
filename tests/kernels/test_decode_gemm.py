"""kernels/decode_gemm.py against grouped_gemm's reference: every weight format and scale layout,
one group and several (empty groups, groups with more rows than a row tile), split K, ragged K."""
import pytest

from interpreter import interpreted_and_gpu

CHECK = """
import torch
from deepinfer.kernels.decode_gemm import _launch, decode_rows, default_config, reference
from test_grouped_gemm import make_case

def check(counts, N, K, fmt, block=(128, 128), scale_dtype='e8m0', **tiles):
    a, w, offs, s = make_case(counts, N, K, fmt, block, scale_dtype, device=DEV)
    want = reference(a.cpu(), w.cpu(), offs.cpu(), None if s is None else s.cpu(), block).float()
    got = _launch(a, w, offs, s, block, **tiles).float().cpu()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2, msg=f'{counts} {N} {K} {fmt} {block} {tiles}')
    if len(counts) == 1:  # one group without offs: a dense Linear
        got = _launch(a, w[0], None, None if s is None else s[0], block, **tiles).float().cpu()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)

small = dict(BLOCK_N=16, BLOCK_K=64, num_warps=1)
for fmt in ('bf16', 'fp8', 'fp4'):
    check([1], 40, 256, fmt, ROWS=1, SPLIT_K=1, **small)
    check([3], 40, 256, fmt, ROWS=2, SPLIT_K=4, **small)        # rows past a tile, K split 4 ways
    check([0, 1, 5, 0, 2], 24, 192, fmt, ROWS=2, SPLIT_K=2, **small)  # empty groups, ragged last split
check([2, 1], 48, 160, 'fp8', block=(32, 32), ROWS=2, SPLIT_K=2, **small)  # 32 x 32: broadcast scales
check([2, 1], 48, 160, 'fp8', block=(16, 48), ROWS=1, SPLIT_K=1, **small)  # odd blocks: per-element
check([2], 40, 256, 'fp8', scale_dtype='fp32', ROWS=2, SPLIT_K=2, **small)
assert decode_rows(1, 1) and decode_rows(384, 256) and not decode_rows(64 * 9, 64) and not decode_rows(0, 1)
cfg = default_config(1, 1, 1536, 4096, 1, 132)
assert cfg['ROWS'] == 1 and cfg['SPLIT_K'] > 1, cfg
print('ok')
"""

test_decode_gemm_interpreted, test_decode_gemm_gpu = interpreted_and_gpu(
    CHECK, "DEV = 'cpu'\n", "DEV = 'cuda'\n")


def test_fp4_scales_must_be_e8m0():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from deepinfer.kernels.decode_gemm import _scale_view
    w = torch.zeros(1, 4, 16, dtype=torch.int8)
    with pytest.raises(TypeError, match="E8M0"):
        _scale_view(w, torch.ones(1, 4, 1), 2, 4, 32, (1, 32))
    with pytest.raises(ValueError, match="expected"):
        _scale_view(w, torch.ones(1, 4, 2, dtype=torch.uint8), 2, 4, 32, (1, 32))


# Every FP4 code under every scale byte 2..252 read back through one-hot rows of A (see test_grouped_gemm).
FP4_EXACT = """
import torch
from test_grouped_gemm import FP4_EXACT
exec(FP4_EXACT.split('for cfg in')[0])  # w, s, a, want
from deepinfer.kernels.decode_gemm import _launch
for cfg in (dict(ROWS=8, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1), dict(ROWS=4, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1)):
    got = _launch(a.to(DEV), w.to(DEV), None, s.to(DEV), (1, 32), num_warps=4, **cfg)
    assert torch.equal(got.float().cpu(), want), (got.float().cpu() - want).abs().max()
print('ok')
"""
test_fp4_bits_exact_interpreted, test_fp4_bits_exact_gpu = interpreted_and_gpu(
    FP4_EXACT, "DEV = 'cpu'\n", "DEV = 'cuda'\n")
