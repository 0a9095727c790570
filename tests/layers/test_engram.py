"""Engram gate: a token's output does not depend on the other rows of the step (batch invariance)."""
from __future__ import annotations

import pytest
import torch

from deepinfer.layers import invariant
from deepinfer.layers.engram import Engram


def _engram(device: str, dim: int = 1024, n: int = 4, rows: int = 512, head_dim: int = 64, heads: int = 4):
    g = torch.Generator().manual_seed(0)
    eng = Engram(dim, n, rows, head_dim, heads, 1e-6, torch.float32).to(device)
    for p in eng.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 2 and p.shape[0] > n else 1.0))
    return eng, g


def _check_rows_invariant(device: str, sizes=(1, 6, 24, 96)):
    eng, g = _engram(device)
    T = 384
    x = torch.randn(T, eng.n, eng.dim, generator=g).to(device)
    idx = torch.randint(0, 512, (T, 4), generator=g).to(device)
    with torch.inference_mode(), invariant.mode(True):
        full = eng(x, idx, None)
        for t in sizes:
            assert torch.equal(eng(x[:t], idx[:t], None), full[:t]), t
            assert torch.equal(eng(x[-t:], idx[-t:], None), full[-t:]), t


def test_engram_rows_are_batch_invariant_on_cpu():
    _check_rows_invariant("cpu", sizes=(1, 6))


def test_reduce_mean_is_torch_mean_outside_invariant_cuda():
    x = torch.randn(5, 7, 33)
    with invariant.mode(True):
        assert torch.equal(invariant.reduce_mean(x, -1), x.mean(-1))
    assert torch.equal(invariant.reduce_mean(x, 1), x.mean(1))


@pytest.mark.gpu
def test_engram_rows_are_batch_invariant_on_gpu():
    """A token's Engram output alone (decode), among 6 (a verify chunk) and among 384 (prefill) is the
    same bits: torch's CUDA row reductions split a row by the tensor's shape (the V4.1 demo's
    speculative verify rows differed from decode here), so invariant mode sums on the fixed GEMM."""
    _check_rows_invariant("cuda")


@pytest.mark.gpu
def test_reduce_mean_matches_mean_on_gpu():
    x = torch.randn(64, 4, 4096, device="cuda")
    with invariant.mode(True):
        got = invariant.reduce_mean(x, -1)
        one = invariant.reduce_mean(x[:1], -1)
    torch.testing.assert_close(got, x.mean(-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(one, got[:1])
