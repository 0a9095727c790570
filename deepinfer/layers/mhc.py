"""Manifold-constrained hyper-connections: n residual streams mixed around each sub-layer.

For a token with streams X [n, D]: pre collapses X to the sub-layer input, post spreads
the sub-layer output back, and comb (doubly stochastic after Sinkhorn) mixes the old
streams: X_new[j] = post[j] * y + sum_i comb[i, j] * X[i] (contraction over comb's FIRST
index; comb is not symmetric).
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import mhc_collapse as _collapse_k
from deepinfer.kernels import mhc_expand as _expand_k
from deepinfer.kernels import mhc_mix as _mix_k
from deepinfer.kernels.mhc_coeffs import mhc_coeffs
from deepinfer.layers import invariant
from deepinfer.layers.linear import dense_linear
from deepinfer.layers.norm import rms_norm


class HyperConnection(nn.Module):
    """One mHC site. Parameters are registered on the owning block as `hc_{site}_{fn,base,scale}`."""

    def __init__(self, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, project_first: bool = False):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.project_first = project_first  # V4.1 projects, then scales by the RMS (same value, other rounding)

    def weights(self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        """x [T, n, D] -> pre [T, n], post [T, n], comb [T, n, n] (all fp32)."""
        n = self.n
        if _fused(x):  # the streams read once, no fp32 copy
            return mhc_coeffs(_mix(x, fn, self.norm_eps), base, scale, n, self.iters, self.hc_eps, invariant.pointwise)
        f = x.flatten(1).float()
        if self.project_first:
            mix = dense_linear(f, fn.float()) * torch.rsqrt(f.square().mean(-1, keepdim=True) + self.norm_eps)
        else:
            mix = dense_linear(rms_norm(f, self.norm_eps), fn.float())
        return mhc_coeffs(mix, base, scale, n, self.iters, self.hc_eps, invariant.pointwise)


def register_hc_params(module: nn.Module, n: int, dim: int, sites=("attn", "ffn")) -> None:
    """`hc_{site}_{fn,base,scale}` (fp32) of each mHC site, named as in the checkpoint."""
    mix = (2 + n) * n
    for site in sites:
        for name, shape in (("fn", (mix, n * dim)), ("base", (mix,)), ("scale", (3,))):
            module.register_parameter(f"hc_{site}_{name}", nn.Parameter(torch.zeros(*shape, dtype=torch.float32),
                                                                        requires_grad=False))


def _fused(x: torch.Tensor) -> bool:
    """The Triton mHC kernels run on CUDA (they round once, in fp32; all are row-local)."""
    return x.is_cuda and _mix_k.triton is not None


def _mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """rms_norm(streams) @ fn^T [T, W] fp32 by the Triton kernel (fixed splits in batch-invariant mode)."""
    return _mix_k.mhc_mix(x.flatten(1), fn, norm_eps, fixed=invariant.enabled())


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre[i] * X[i]: [T, n, D] -> [T, D] in x's dtype."""
    if _fused(x):
        return _collapse_k.mhc_collapse(x, pre)
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def collapse_norm(x: torch.Tensor, pre: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(collapse(x, pre)) for an RMSNorm `norm` (fp32 weight): one kernel on CUDA."""
    if _fused(x):
        return _collapse_k.mhc_collapse(x, pre, norm.weight, norm.eps)
    return norm(collapse(x, pre))


def expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_new[j] = post[j] * y + sum_i comb[i, j] * X[i]: [T, n, D] in x's dtype."""
    if _fused(x):
        return _expand_k.mhc_expand(x, y, post, comb)
    dt = x.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tij,tid->tjd", comb.to(dt), x)


def head_collapse(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final hc_head: sigmoid weights, no Sinkhorn, no post/comb."""
    mix = _mix(x, fn, norm_eps) if _fused(x) else dense_linear(rms_norm(x.flatten(1), norm_eps), fn.float())
    pre = invariant.pointwise(torch.sigmoid, mix * scale.float() + base.float()) + hc_eps
    return collapse(x, pre)
