"""V4's MoE router after its GEMM: sqrt-softplus scores, expert choice, renormalised weights.

logits [T, E] fp32 (x @ gate.weight^T), per row t:
  s[e]    = sqrt(softplus(logits[t, e]))         softplus(x) = x for x > 20, else log1p(exp(x))
  idx[t]  = tid2eid[ids[t]]                       hash layers (k ids from the token's table row)
          = the k largest s[e] + bias[e]          top-k layers, best first; equal values: lowest e
            (bias_vl[e] instead of bias[e] for image tokens, V4.1)
  w[t, j] = s[idx[t, j]] / sum_j' s[idx[t, j']] * route_scale
The torch form is softplus, sqrt, index (hash) or add + topk, gather, sum, divide, multiply: ~7
launches per layer after the GEMM; this is one. A row's result depends on that row alone (the k-sum
runs in the kernel's fixed order), so it is batch-invariant as it is. log1p is computed as
log(1 + u) * u / ((1 + u) - 1) (exact to ~1 ulp, plain tl ops); values may differ from torch's by
an ulp or so, never the choice of experts unless two biased scores are that close.
Top-k selection: k rounds of argmax over the row (ties to the lowest index), each chosen expert
masked out for the next round; k <= 16.
Grid: one program per token row, E <= 1024 in registers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

MAX_EXPERTS = 1024
MAX_K = 16


def scores(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits.float()).sqrt()


def reference(logits: torch.Tensor, k: int, route_scale: float, ids: torch.Tensor | None = None,
              tid2eid: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              bias_vl: torch.Tensor | None = None, image_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, idx [T, k] int64); hash routing when tid2eid is given, else top-k."""
    s = scores(logits)
    if tid2eid is not None:
        idx = tid2eid[ids].long()
    else:
        b = bias if image_mask is None else torch.where(image_mask[:, None], bias_vl, bias)
        idx = torch.topk(s + b, k, dim=-1).indices
    w = s.gather(1, idx)
    return w / w.sum(-1, keepdim=True) * route_scale, idx


if triton is not None:
    @triton.jit
    def _router_kernel(logit_ptr, ids_ptr, table_ptr, bias_ptr, bias_vl_ptr, image_ptr, w_ptr, idx_ptr,
                       E, stride_l, stride_table, route_scale, K: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, HASHED: tl.constexpr, HAS_IMAGE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        live = e < E
        x = tl.load(logit_ptr + t * stride_l + e, mask=live, other=0.0)
        u = tl.exp(x)
        one_u = 1.0 + u
        log1p = tl.where(one_u == 1.0, u, tl.log(one_u) * (u / (one_u - 1.0)))
        s = tl.sqrt(tl.where(x > 20.0, x, log1p))
        j = tl.arange(0, BLOCK_K)
        jm = j < K
        if HASHED:
            tok = tl.load(ids_ptr + t).to(tl.int64)
            idx = tl.load(table_ptr + tok * stride_table + j, mask=jm, other=0).to(tl.int64)
        else:
            b = tl.load(bias_ptr + e, mask=live, other=0.0)
            if HAS_IMAGE:
                if tl.load(image_ptr + t) != 0:
                    b = tl.load(bias_vl_ptr + e, mask=live, other=0.0)
            sel = tl.where(live, s + b, float("-inf"))
            idx = tl.zeros([BLOCK_K], tl.int64)
            for r in tl.static_range(K):
                best = tl.max(sel, axis=0)
                pick = tl.minimum(tl.min(tl.where(sel == best, e, BLOCK_E), axis=0), E - 1)  # ties: lowest
                # index (the clamp keeps a NaN row's picks in range)
                idx = tl.where(j == r, pick.to(tl.int64), idx)
                sel = tl.where(e == pick, float("-inf"), sel)
        # gather s[idx]: compare against the row held in registers (E <= BLOCK_E)
        hit = (idx[:, None] == e[None, :]) & jm[:, None]
        w = tl.sum(tl.where(hit, s[None, :], 0.0), axis=1)
        total = tl.sum(w, axis=0)
        tl.store(w_ptr + t * K + j, w / total * route_scale, mask=jm)
        tl.store(idx_ptr + t * K + j, idx, mask=jm)


def supported(logits: torch.Tensor, k: int) -> bool:
    return (triton is not None and logits.is_cuda and logits.dtype == torch.float32
            and 0 < logits.shape[1] <= MAX_EXPERTS and 0 < k <= MAX_K)


def route(logits: torch.Tensor, k: int, route_scale: float, ids: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, bias: torch.Tensor | None = None,
          bias_vl: torch.Tensor | None = None, image_mask: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Triton launch on CUDA; `reference` elsewhere. Same contract."""
    if not supported(logits, k) or logits.shape[0] == 0:
        return reference(logits, k, route_scale, ids, tid2eid, bias, bias_vl, image_mask)
    return _launch(logits, k, route_scale, ids, tid2eid, bias, bias_vl, image_mask)


def _launch(logits, k, route_scale, ids=None, tid2eid=None, bias=None, bias_vl=None, image_mask=None):
    """The launch without the device checks (also runs under TRITON_INTERPRET=1)."""
    T, E = logits.shape
    hashed = tid2eid is not None
    if hashed and (ids is None or tid2eid.shape[1] != k):
        raise ValueError(f"route: hash routing needs ids and a [vocab, {k}] table, got {tuple(tid2eid.shape)}")
    if not hashed and bias is None:
        raise ValueError("route: top-k routing needs a bias")
    if hashed:
        ids, tid2eid = ids.contiguous(), tid2eid.contiguous()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    has_image = image_mask is not None
    dummy = logits
    _router_kernel[(T,)](
        logits, ids if hashed else dummy, tid2eid if hashed else dummy,
        dummy if hashed else bias.float().contiguous(),
        bias_vl.float().contiguous() if has_image else dummy,
        image_mask.to(torch.int8) if has_image else dummy, w, idx, E, logits.stride(0),
        tid2eid.stride(0) if hashed else 0, float(route_scale), K=k, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=max(2, triton.next_power_of_2(k)), HASHED=hashed, HAS_IMAGE=has_image and not hashed,
        num_warps=4)
    return w, idx
