"""MoE combine: gather each token's k expert outputs back from the expert-sorted rows and sum them.

The (token t, slot j) pairs, flattened as p = t * k + j, are sorted by expert: sorted row r holds
pair order[r], so pair p sits at row inv[p] with inv = order^-1. Then, for y [T * k, D] (bf16)
and routing weights [T, k] (fp32):

    out[t, :] = sum_{j = 0 .. k-1} weights[t, j] * float(y[inv[t * k + j], :])      out [T, D] fp32
    (optionally then out += float(add[t, :]), the shared expert's output, and out is rounded to
    out_dtype: the MoE layer's result in one pass instead of a float copy, an add and a cast)

Order of summation (the invariant the GPU kernel and `reference` share bit for bit): the
accumulator starts at 0.0 and the k products (each rounded to fp32) are added in j order, one
fp32 add at a time, never fused into an FMA; `add` comes last, one more fp32 add. An
`index_add_` over the sorted rows would sum in expert order (and, on the GPU, atomically), so a
token's result would depend on which experts the other tokens chose; here it depends on the
token's own k outputs and weights only (batch invariance).

`inv_stride` k + 1 (moe_align's shared_slot: slot k of each token is the shared expert's row, passed as
`add`): inv holds k + 1 rows a token and the first k are summed. `inv` comes from moe_align, or is built on the
device with a scatter (no host sync); the grid is
(T, cdiv(D, BLOCK_D)) from shapes only, so the whole thing is CUDA-graph capturable. Each program
loads its token's k row indices and weights, then k row segments of BLOCK_D columns.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inv with inv[order[r]] = r, on order's device, without a host sync."""
    inv = torch.empty_like(order)
    return inv.scatter_(0, order, torch.arange(order.numel(), dtype=order.dtype, device=order.device))


def reference(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, k: int, inv: torch.Tensor | None = None,
              add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
              inv_stride: int | None = None) -> torch.Tensor:
    """y [T*k, D] sorted by expert, order [T*k] (sorted row -> pair t*k+j), weights [T, k] -> [T, D],
    summed over j in order in fp32, plus `add` [T, D] when given, rounded to out_dtype. `inv`:
    order's inverse when the caller has it (kernels/moe_align.py returns it)."""
    T = weights.shape[0]
    rows = (inverse_permutation(order) if inv is None else inv).view(T, inv_stride or k)
    w = weights.float()
    out = torch.zeros(T, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(k):
        out += y[rows[:, j]].float() * w[:, j, None]
    if add is not None:
        out += add.float()
    return out.to(out_dtype)


if triton is not None:
    @triton.jit
    def _combine_kernel(y_ptr, inv_ptr, w_ptr, add_ptr, out_ptr, D, stride_y, stride_add, K: tl.constexpr,
                        BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr, INV_STRIDE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + t * INV_STRIDE + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j)
            v = tl.load(y_ptr + row * stride_y + cols, mask=live, other=0.0).to(tl.float32)
            acc += v * w  # enable_fp_fusion=False at launch: a rounded product, then a rounded add
        if HAS_ADD:
            acc += tl.load(add_ptr + t * stride_add + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def moe_combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, k: int, inv: torch.Tensor | None = None,
                add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                inv_stride: int | None = None) -> torch.Tensor:
    """Fused on CUDA (Triton), the torch reference elsewhere; same contract (and bits) as `reference`."""
    if triton is None or not y.is_cuda:
        return reference(y, order, weights, k, inv, add, out_dtype, inv_stride)
    return _launch(y, order, weights, k, inv, add, out_dtype, inv_stride)


def _launch(y, order, weights, k: int, inv=None, add=None, out_dtype: torch.dtype = torch.float32,
            inv_stride: int | None = None) -> torch.Tensor:
    """The launch without the device check (also runs under TRITON_INTERPRET=1)."""
    T, D = weights.shape[0], y.shape[1]
    stride = inv_stride or k
    assert weights.shape == (T, k) and y.shape[0] == order.numel() == T * stride and stride >= k, \
        (y.shape, order.shape, weights.shape, inv_stride)
    if y.stride(1) != 1:
        y = y.contiguous()
    if add is not None and (add.shape != (T, D) or add.stride(1) != 1):
        raise ValueError(f"moe_combine: add {tuple(add.shape)} must be [{T}, {D}] with unit column stride")
    inv = inverse_permutation(order) if inv is None else inv
    w = weights.float().contiguous()
    out = torch.empty(T, D, dtype=out_dtype, device=y.device)
    if T == 0 or D == 0:
        return out
    block = min(512, triton.next_power_of_2(D))
    _combine_kernel[(T, triton.cdiv(D, block))](y, inv, w, y if add is None else add, out, D, y.stride(0),
                                                0 if add is None else add.stride(0), K=k, BLOCK_D=block,
                                                HAS_ADD=add is not None, INV_STRIDE=stride, num_warps=4,
                                                enable_fp_fusion=False)
    return out
