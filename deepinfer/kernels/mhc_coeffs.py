"""mHC coefficients in one kernel: pre / post / Sinkhorn-projected comb from the 24 mixes.

Per row (one token), with n = 4 streams and mix [24] = fn @ f / rms(f):
  pre  = sigmoid(mix[0:4]  * scale[0] + base[0:4])  + eps
  post = 2 * sigmoid(mix[4:8] * scale[1] + base[4:8])
  comb = softmax_rows(mix[8:24].view(4, 4) * scale[2] + base[8:24].view(4, 4)) + eps
  comb = comb / (colsum + eps); then (iters - 1) x: comb / (rowsum + eps), comb / (colsum + eps)
The torch version of these ~130 elementwise/reduction launches is `reference`; the Triton
kernel keeps a block of rows' 4x4 matrices in registers. Grid: one program per BLOCK rows.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def _apply(fn, x):
    return fn(x)


def reference(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float,
              pointwise=_apply):
    """mix [T, (2+n)*n] fp32 -> pre [T, n], post [T, n], comb [T, n, n] (fp32). `pointwise(fn, x)`
    applies the sigmoids (layers/invariant.pointwise in batch-invariant mode on the CPU)."""
    pre = pointwise(torch.sigmoid, mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * pointwise(torch.sigmoid, mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


if triton is not None:
    @triton.jit
    def _mhc_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, eps,
                    N: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        W: tl.constexpr = (2 + N) * N
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                  # [BLOCK]
        live = rows < T
        i = tl.arange(0, N)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m_pre = tl.load(mix_ptr + rows[:, None] * W + i[None, :], mask=live[:, None], other=0.0)
        m_post = tl.load(mix_ptr + rows[:, None] * W + N + i[None, :], mask=live[:, None], other=0.0)
        pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + i)[None, :]) + eps
        post = 2 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + N + i)[None, :])
        tl.store(pre_ptr + rows[:, None] * N + i[None, :], pre, mask=live[:, None])
        tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=live[:, None])
        cell = i[:, None] * N + i[None, :]                                       # [N, N] row-major
        c = tl.load(mix_ptr + rows[:, None, None] * W + 2 * N + cell[None, :, :], mask=live[:, None, None],
                    other=0.0)
        c = c * s2 + tl.load(base_ptr + 2 * N + cell)[None, :, :]
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        c = c / tl.sum(c, axis=2)[:, :, None] + eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        for _ in tl.static_range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        tl.store(comb_ptr + rows[:, None, None] * (N * N) + cell[None, :, :], c, mask=live[:, None, None])


def mhc_coeffs(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float,
               pointwise=_apply):
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`."""
    if triton is None or not mix.is_cuda or n & (n - 1):
        return reference(mix, base, scale, n, iters, eps, pointwise)
    return _launch(mix, base, scale, n, iters, eps)


def _launch(mix, base, scale, n: int, iters: int, eps: float, block: int = 64, num_warps: int = 4):
    """The launch (rows per program and warps are row-local choices: a row's values do not depend on them)."""
    mix = mix.contiguous().float()
    T = mix.shape[0]
    pre = torch.empty(T, n, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=mix.device)
    _mhc_kernel[(triton.cdiv(T, block),)](mix, base.float().contiguous(), scale.float().contiguous(), pre, post,
                                          comb, T, eps, N=n, ITERS=iters, BLOCK=block, num_warps=num_warps)
    return pre, post, comb
