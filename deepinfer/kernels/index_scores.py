"""Lightning-indexer scores of one request's tokens against its compressed-entry keys (and, for
decode, of each token against its own request's keys: `index_scores_per_token`).

q [T, H, Dh] and keys [E, Dh] in bf16, w [T, H] fp32 (head weights, scale folded in), visible [T]
(entries 0 .. visible[t] - 1 are visible to token t):
  scores[t, e] = sum_{h = 0..H-1} w[t, h] * relu(q[t, h] . keys[e])     if e < visible[t]
               = -inf                                                  otherwise
fp32 out. The torch form materialises [T, H, E] fp32 logits (three passes over them: GEMM, relu,
weighted head sum); the kernel keeps a [BLOCK_T, BLOCK_E] accumulator and never writes them.

Kernel: grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E)); the key tile [BLOCK_E, Dh] is loaded once and
reused for every head. Invariants:
  * q . k is one tl.dot over the whole Dh (bf16 products are exact in fp32; fp32 accumulation),
    and heads are added in the fixed order h = 0, 1, ..., so an element's bits depend only on its
    own token's q, w and the key, never on T, E or the other rows of the tile: batch-invariant
    with the tile sizes fixed (they are constants here).
  * a tile with no visible entry for any of its tokens (causal prefill: about half) stores -inf
    without computing.
  * Dh must be a power of two >= 16 (one tl.dot over it).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK_T, BLOCK_E = 64, 64


def reference(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Plain torch, fp32 math: same contract as `index_scores`."""
    logits = torch.einsum("thd,ed->the", q.float(), keys.float()).relu()
    s = torch.einsum("the,th->te", logits, w.float())
    return s.masked_fill(torch.arange(keys.shape[0], device=q.device) >= visible[:, None], float("-inf"))


if triton is not None:
    @triton.jit
    def _index_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, out_ptr, T, E, H, DH: tl.constexpr,
                             BT: tl.constexpr, BE: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        t_ok, e_ok = t < T, e < E
        vis = tl.load(vis_ptr + t, mask=t_ok, other=0)
        seen = e[None, :] < vis[:, None]                                              # [BT, BE]
        t64 = t.to(tl.int64)
        acc = tl.zeros([BT, BE], tl.float32)
        if tl.max(vis, axis=0) > tl.program_id(1) * BE:
            d = tl.arange(0, DH)
            k = tl.load(k_ptr + e.to(tl.int64)[:, None] * DH + d[None, :], mask=e_ok[:, None], other=0.0)
            kt = tl.trans(k)
            for h in range(H):
                qh = tl.load(q_ptr + (t64 * H + h)[:, None] * DH + d[None, :], mask=t_ok[:, None], other=0.0)
                wh = tl.load(w_ptr + t64 * H + h, mask=t_ok, other=0.0)
                s = tl.dot(qh, kt)                                                    # fp32 accumulation
                acc += wh[:, None] * tl.maximum(s, 0.0)
        acc = tl.where(seen, acc, float("-inf"))
        tl.store(out_ptr + t64[:, None] * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


if triton is not None:
    @triton.jit
    def _per_token_kernel(q_ptr, k_ptr, addr_ptr, req_ptr, w_ptr, vis_ptr, out_ptr, V, stride_a, H: tl.constexpr,
                          DH: tl.constexpr, BH: tl.constexpr, BE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        vis = tl.load(vis_ptr + t)
        seen = e < vis
        acc = tl.zeros([BE], tl.float32)
        if tl.program_id(1) * BE < vis:
            d = tl.arange(0, DH)
            h = tl.arange(0, BH)
            h_ok = h < H
            rows = tl.load(addr_ptr + tl.load(req_ptr + t) * stride_a + e, mask=seen, other=0)
            k = tl.load(k_ptr + rows.to(tl.int64)[:, None] * DH + d[None, :], mask=seen[:, None], other=0.0)
            q = tl.load(q_ptr + (t * H + h)[:, None] * DH + d[None, :], mask=h_ok[:, None], other=0.0)
            w = tl.load(w_ptr + t * H + h, mask=h_ok, other=0.0)
            s = tl.dot(q, tl.trans(k))                                                    # [BH, BE] fp32
            acc = tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0)
        tl.store(out_ptr + t * V + e, tl.where(seen, acc, float("-inf")), mask=e < V)


def reference_per_token(q: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, token_req: torch.Tensor,
                        w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Each token against its own request's entries: keys row table[token_req[t], e] for e < V."""
    kk = keys[table[token_req]].float()                                               # [T, V, Dh]
    s = torch.einsum("the,th->te", torch.einsum("thd,ted->the", q.float(), kk).relu(), w.float())
    return s.masked_fill(torch.arange(table.shape[1], device=q.device) >= visible[:, None], float("-inf"))


def index_scores_per_token(q: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, token_req: torch.Tensor,
                           w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[T, V] scores of each token against the V entries of its own request (decode: one token per
    request), keys gathered by address inside the kernel: no [T, V, Dh] fp32 copy of the keys.
    Heads are summed by a reduction whose order may differ from `index_scores`' head loop, so this
    is not for batch-invariant mode (which scores every request through `index_scores`)."""
    if not supported(q, keys) or q.shape[1] > 128:
        return reference_per_token(q, keys, table, token_req, w, visible)
    return _launch_per_token(q, keys, table, token_req, w, visible)


def _launch_per_token(q, keys, table, token_req, w, visible, block_e: int = 64) -> torch.Tensor:
    """The launch without the device / dtype checks (also runs under TRITON_INTERPRET=1)."""
    T, H, Dh = q.shape
    V = table.shape[1]
    out = torch.empty(T, V, dtype=torch.float32, device=q.device)
    if T == 0 or V == 0:
        return out
    table = table.contiguous()
    _per_token_kernel[(T, triton.cdiv(V, block_e))](
        q.contiguous(), keys.contiguous(), table, token_req.contiguous(), w.float().contiguous(),
        visible.to(torch.int32).contiguous(), out, V, table.stride(0), H=H, DH=Dh,
        BH=max(16, triton.next_power_of_2(H)), BE=block_e, num_warps=4, num_stages=2)
    return out


def supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    Dh = q.shape[-1]
    return (triton is not None and q.is_cuda and q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16
            and Dh >= 16 and Dh & (Dh - 1) == 0)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA for bf16 q / keys (see `supported`), `reference` otherwise."""
    if not supported(q, keys):
        return reference(q, keys, w, visible)
    return _launch(q, keys, w, visible)


def _launch(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The launch without the device / dtype checks (also runs under TRITON_INTERPRET=1)."""
    T, H, Dh = q.shape
    E = keys.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=q.device)
    if T == 0 or E == 0:
        return out
    _index_scores_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(E, BLOCK_E))](
        q.contiguous(), keys.contiguous(), w.float().contiguous(), visible.to(torch.int32).contiguous(), out,
        T, E, H, DH=Dh, BT=BLOCK_T, BE=BLOCK_E, num_warps=4, num_stages=2)
    return out
