"""mHC expand: the sub-layer output spread back over the streams, mixed with the old streams.

For a token with streams X [n, D], sub-layer output y [D], post [n] and comb [n, n] (fp32):
  X_new[j] = post[j] * y + sum_i comb[i, j] * X[i]      (fp32, one rounding to X's dtype)
The torch form is a batched 4x4 GEMM per token (a slow batched kernel at prefill sizes), a
broadcast multiply and an add, each a pass over [T, n, D]; this reads X and y once and writes
X_new once. Grid: (token, D block).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def reference(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Plain torch in fp32: x [T, n, D], y [T, D], post [T, n], comb [T, n, n] -> [T, n, D] in x's dtype."""
    out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("tij,tid->tjd", comb.float(), x.float())
    return out.to(x.dtype)


if triton is not None:
    @triton.jit
    def _expand_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, D: tl.constexpr, N: tl.constexpr,
                       BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        live = cols < D
        j = tl.arange(0, N)
        y = tl.load(y_ptr + t * D + cols, mask=live, other=0.0).to(tl.float32)
        acc = tl.load(post_ptr + t * N + j)[:, None] * y[None, :]                         # [N, BD]
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + (t * N + i) * D + cols, mask=live, other=0.0).to(tl.float32)
            acc += tl.load(comb_ptr + t * N * N + i * N + j)[:, None] * xi[None, :]
        tl.store(out_ptr + (t * N + j[:, None]) * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[None, :])


def mhc_expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract as `reference`."""
    if triton is None or not x.is_cuda or x.shape[0] == 0 or x.shape[1] & (x.shape[1] - 1):
        return reference(x, y, post, comb)
    return _launch(x, y, post, comb)


def _launch(x, y, post, comb):
    T, n, D = x.shape
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    bd = min(1024, triton.next_power_of_2(D))
    _expand_kernel[(T, triton.cdiv(D, bd))](x, y, post.float().contiguous(), comb.float().contiguous(), out,
                                            D=D, N=n, BD=bd, num_warps=4)
    return out
