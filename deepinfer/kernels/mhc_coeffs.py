"""mHC coefficients in one kernel: pre / post / Sinkhorn-projected comb from the 24 mixes.

Per row (one token), with n = 4 streams and mix [24] = fn @ f / rms(f):
  pre  = sigmoid(mix[0:4]  * scale[0] + base[0:4])  + eps
  post = 2 * sigmoid(mix[4:8] * scale[1] + base[4:8])
  comb = softmax_rows(mix[8:24].view(4, 4) * scale[2] + base[8:24].view(4, 4)) + eps
  comb = comb / (colsum + eps); then (iters - 1) x: comb / (rowsum + eps), comb / (colsum + eps)
The torch version of these ~130 elementwise/reduction launches is `reference`; the Triton
kernel keeps a block of rows' 4x4 matrices in registers. Grid: one program per BLOCK rows.
`mhc_coeffs_from_partials` takes the mixes as S split-K partials (kernels/mhc_mix.py) and forms
mix = sum_s part[s] * rsqrt(sum_s sq[s] / K + norm_eps), summing splits in split order.
"""
from __future__ import annotations

import torch

from deepinfer.layers import invariant  # batch-invariant mode: elementwise ops padded (CPU reference)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def reference(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """mix [T, (2+n)*n] fp32 -> pre [T, n], post [T, n], comb [T, n, n] (fp32)."""
    pre = invariant.pointwise(torch.sigmoid, mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * invariant.pointwise(torch.sigmoid, mix[:, n:2 * n] * scale[1] + base[n:2 * n])
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
                    N: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
                    sq_ptr=None, S: tl.constexpr = 1, K=1, norm_eps=0.0, HAS_NORM: tl.constexpr = False):
        W: tl.constexpr = (2 + N) * N
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                  # [BLOCK]
        live = rows < T
        i = tl.arange(0, N)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m_pre = tl.load(mix_ptr + rows[:, None] * W + i[None, :], mask=live[:, None], other=0.0)
        m_post = tl.load(mix_ptr + rows[:, None] * W + N + i[None, :], mask=live[:, None], other=0.0)
        cell = i[:, None] * N + i[None, :]                                       # [N, N] row-major
        c = tl.load(mix_ptr + rows[:, None, None] * W + 2 * N + cell[None, :, :], mask=live[:, None, None],
                    other=0.0)
        if HAS_NORM:  # mix_ptr holds S partials [S, T, W]; split order is the summation order
            ssq = tl.load(sq_ptr + rows, mask=live, other=0.0)
            for s in tl.static_range(1, S):
                at = mix_ptr + s * T * W
                m_pre += tl.load(at + rows[:, None] * W + i[None, :], mask=live[:, None], other=0.0)
                m_post += tl.load(at + rows[:, None] * W + N + i[None, :], mask=live[:, None], other=0.0)
                c += tl.load(at + rows[:, None, None] * W + 2 * N + cell[None, :, :], mask=live[:, None, None],
                             other=0.0)
                ssq += tl.load(sq_ptr + s * T + rows, mask=live, other=0.0)
            r = tl.rsqrt(ssq / K + norm_eps)
            m_pre = m_pre * r[:, None]
            m_post = m_post * r[:, None]
            c = c * r[:, None, None]
        pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + i)[None, :]) + eps
        post = 2 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + N + i)[None, :])
        tl.store(pre_ptr + rows[:, None] * N + i[None, :], pre, mask=live[:, None])
        tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=live[:, None])
        c = c * s2 + tl.load(base_ptr + 2 * N + cell)[None, :, :]
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        c = c / tl.sum(c, axis=2)[:, :, None] + eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        for _ in tl.static_range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        tl.store(comb_ptr + rows[:, None, None] * (N * N) + cell[None, :, :], c, mask=live[:, None, None])


def mhc_coeffs(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`."""
    if triton is None or not mix.is_cuda or n & (n - 1):
        return reference(mix, base, scale, n, iters, eps)
    return _launch(mix.contiguous().float(), None, 0, 0.0, base, scale, n, iters, eps)


def reference_from_partials(part, sq, K: int, norm_eps: float, base, scale, n: int, iters: int, eps: float):
    """Plain torch: same contract as `mhc_coeffs_from_partials`."""
    mix = part.sum(0) * torch.rsqrt(sq.sum(0) / K + norm_eps)[:, None]
    return reference(mix, base, scale, n, iters, eps)


def mhc_coeffs_from_partials(part: torch.Tensor, sq: torch.Tensor, K: int, norm_eps: float, base: torch.Tensor,
                             scale: torch.Tensor, n: int, iters: int, eps: float):
    """part [S, T, (2+n)*n], sq [S, T] (fp32 split-K sums over the K = n*D flattened streams) ->
    pre, post, comb as `reference` gives them for mix = rms_norm(f) @ fn^T."""
    if triton is None or not part.is_cuda or n & (n - 1):
        return reference_from_partials(part, sq, K, norm_eps, base, scale, n, iters, eps)
    return _launch(part, sq, K, norm_eps, base, scale, n, iters, eps)


def _launch(mix, sq, K, norm_eps, base, scale, n, iters, eps):
    T = mix.shape[-2]
    pre = torch.empty(T, n, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=mix.device)
    block = 64
    extra = {} if sq is None else dict(sq_ptr=sq, S=mix.shape[0], K=K, norm_eps=norm_eps, HAS_NORM=True)
    _mhc_kernel[(triton.cdiv(T, block),)](mix, base.float().contiguous(), scale.float().contiguous(), pre, post,
                                          comb, T, eps, N=n, ITERS=iters, BLOCK=block, **extra)
    return pre, post, comb
