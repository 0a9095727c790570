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

Key formats (FMT, both kernels): "bfloat16" rows [R, Dh], or "mxfp4" rows as V4.1's FormatStore
keeps them (deepinfer/formats/group_quant.py): E2M1 codes two per byte, even column in the low
nibble [R, Dh/2] uint8, one E8M0 scale byte per 32 columns [R, Dh/32]. The kernels decode mxfp4
in registers to bf16, exactly: a value is e2m1 * 2^(s-127), at most two significant bits times a
power of two in bf16's (= fp32's) exponent range, so bf16 holds it without rounding; scale byte 0
(never written: the encoder's scales are >= 2^-126) decodes as 0. With `rows` (shared kernel) or
the address table (per-token kernel) keys are read at their cache addresses: no gathered copy.
The torch references decode with group_quant.decode and score in fp32 (q . k per head, relu,
times w, summed over heads); the kernels differ from them only in fp32 summation order (the q . k
products of bf16 / decoded values are exact in fp32): over Dh the MMA's order (torch: its GEMM's),
over heads h = 0, 1, ... in turn in the shared kernel and a fixed tree over BH lanes in the
per-token kernel (torch: its sum over the head dim). With V4.1's mxfp4 queries and keys, q . k is
a short sum of few-bit products and usually exact in any order; the head sum is where bits differ.
"""
from __future__ import annotations

import torch

from deepinfer.formats import group_quant

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK_T, BLOCK_E = 64, 64
FORMATS = {"bfloat16": 0, "mxfp4": 1}  # key layouts the kernels read (FMT)


def reference(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Plain torch, fp32 math: same contract as `index_scores`."""
    logits = torch.einsum("thd,ed->the", q.float(), keys.float()).relu()
    s = torch.einsum("the,th->te", logits, w.float())
    return s.masked_fill(torch.arange(keys.shape[0], device=q.device) >= visible[:, None], float("-inf"))


if triton is not None:
    @triton.jit
    def _load_keys(k_ptr, ks_ptr, rows, ok, DH: tl.constexpr, FMT: tl.constexpr):
        """Key rows `rows` (where ok) as a [len(rows), DH] bf16 tile; mxfp4 decoded exactly."""
        d = tl.arange(0, DH)
        r = rows.to(tl.int64)[:, None]
        m = ok[:, None]
        if FMT == 0:
            k = tl.load(k_ptr + r * DH + d[None, :], mask=m, other=0.0)
        else:
            byte = tl.load(k_ptr + r * (DH // 2) + (d // 2)[None, :], mask=m, other=0).to(tl.int32)
            nib = (byte >> ((d % 2) * 4)[None, :]) & 15
            mag = nib & 7
            e = mag >> 1
            half = tl.where(e == 0, mag, (2 + (mag & 1)) << tl.maximum(e - 1, 0))  # |value| in halves: 0..12
            sb = tl.load(ks_ptr + r * (DH // 32) + (d // 32)[None, :], mask=m, other=0).to(tl.int32)
            v = half.to(tl.float32) * 0.5 * (sb << 23).to(tl.float32, bitcast=True)  # times 2^(sb - 127)
            k = tl.where(nib >= 8, -v, v)
        return k.to(tl.bfloat16)

    @triton.jit
    def _index_scores_kernel(q_ptr, k_ptr, ks_ptr, rows_ptr, w_ptr, vis_ptr, out_ptr, T, E, H, DH: tl.constexpr,
                             BT: tl.constexpr, BE: tl.constexpr, FMT: tl.constexpr, GATHER: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        t_ok, e_ok = t < T, e < E
        vis = tl.load(vis_ptr + t, mask=t_ok, other=0)
        seen = e[None, :] < vis[:, None]                                              # [BT, BE]
        t64 = t.to(tl.int64)
        acc = tl.zeros([BT, BE], tl.float32)
        vmax = tl.max(vis, axis=0)
        if vmax > tl.program_id(1) * BE:
            d = tl.arange(0, DH)
            k_ok = e_ok & (e < vmax)  # an entry no token of the tile sees is not read (its address may be padding)
            if GATHER:
                rows = tl.load(rows_ptr + e, mask=k_ok, other=0)
            else:
                rows = e
            kt = tl.trans(_load_keys(k_ptr, ks_ptr, rows, k_ok, DH, FMT))
            for h in range(H):
                qh = tl.load(q_ptr + (t64 * H + h)[:, None] * DH + d[None, :], mask=t_ok[:, None], other=0.0)
                wh = tl.load(w_ptr + t64 * H + h, mask=t_ok, other=0.0)
                s = tl.dot(qh, kt)                                                    # fp32 accumulation
                acc += wh[:, None] * tl.maximum(s, 0.0)
        acc = tl.where(seen, acc, float("-inf"))
        tl.store(out_ptr + t64[:, None] * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


if triton is not None:
    @triton.jit
    def _per_token_kernel(q_ptr, k_ptr, ks_ptr, addr_ptr, req_ptr, w_ptr, vis_ptr, out_ptr, V, stride_a,
                          H: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr, BE: tl.constexpr, FMT: tl.constexpr):
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
            k = _load_keys(k_ptr, ks_ptr, rows, seen, DH, FMT)
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


def read_keys(store: tuple[torch.Tensor, ...], fmt: str, rows: torch.Tensor) -> torch.Tensor:
    """fp32 values of key rows `rows` of a store (its tensors: (data,) or (codes, scales)) in `fmt`."""
    if fmt == "mxfp4":
        return group_quant.decode(store[0][rows], store[1][rows], fmt, torch.float32)
    return store[0][rows].float()


def reference_store(q: torch.Tensor, store: tuple[torch.Tensor, ...], fmt: str, rows: torch.Tensor,
                    w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`reference` against the keys at addresses `rows` [E] of a store in `fmt`."""
    return reference(q, read_keys(store, fmt, rows), w, visible)


def reference_store_per_token(q: torch.Tensor, store: tuple[torch.Tensor, ...], fmt: str, table: torch.Tensor,
                              token_req: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`reference_per_token` against a store in `fmt`: key of (t, e) at table[token_req[t], e]."""
    rows = torch.arange(store[0].shape[0], device=table.device)
    return reference_per_token(q, read_keys(store, fmt, rows), table, token_req, w, visible)


def index_scores_per_token(q: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, token_req: torch.Tensor,
                           w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[T, V] scores of each token against the V entries of its own request (decode: one token per
    request), keys gathered by address inside the kernel: no [T, V, Dh] fp32 copy of the keys.
    One program scores one token (tiling fixed by H alone), so a token's bits depend only on its
    own inputs; heads are summed by a reduction whose order differs from `index_scores`' head
    loop, so a caller that mixes the two kernels is not batch-invariant (V4's invariant mode
    scores every request through `index_scores`)."""
    if not supported(q, keys) or q.shape[1] > 128:
        return reference_per_token(q, keys, table, token_req, w, visible)
    return _launch_per_token(q, keys, table, token_req, w, visible)


def _launch_per_token(q, keys, table, token_req, w, visible, block_e: int = 64, *, scale=None,
                      fmt: str = "bfloat16") -> torch.Tensor:
    """The launch without the device / dtype checks (also runs under TRITON_INTERPRET=1). mxfp4:
    `keys` are the codes, `scale` the scale bytes."""
    T, H, Dh = q.shape
    V = table.shape[1]
    out = torch.empty(T, V, dtype=torch.float32, device=q.device)
    if T == 0 or V == 0:
        return out
    table = table.contiguous()
    keys = keys.contiguous()
    _per_token_kernel[(T, triton.cdiv(V, block_e))](
        q.contiguous(), keys, keys if scale is None else scale.contiguous(), table, token_req.contiguous(),
        w.float().contiguous(), visible.to(torch.int32).contiguous(), out, V, table.stride(0), H=H, DH=Dh,
        BH=max(16, triton.next_power_of_2(H)), BE=block_e, FMT=FORMATS[fmt], num_warps=4, num_stages=2)
    return out


def supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    Dh = q.shape[-1]
    return (triton is not None and q.is_cuda and q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16
            and Dh >= 16 and Dh & (Dh - 1) == 0)


def supported_store(q: torch.Tensor, fmt: str) -> bool:
    """The kernels can score bf16 q against keys stored in `fmt` (on any device: the caller checks it)."""
    Dh = q.shape[-1]
    return (triton is not None and q.dtype == torch.bfloat16 and fmt in FORMATS and q.shape[1] <= 128
            and Dh >= 32 and Dh & (Dh - 1) == 0)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA for bf16 q / keys (see `supported`), `reference` otherwise."""
    if not supported(q, keys):
        return reference(q, keys, w, visible)
    return _launch(q, keys, w, visible)


def index_scores_store(q: torch.Tensor, store: tuple[torch.Tensor, ...], fmt: str, rows: torch.Tensor,
                       w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`index_scores` of one request's tokens against the keys at addresses `rows` [E] of a store in
    `fmt` ("bfloat16" / "mxfp4"), read in the kernel; `reference_store` off CUDA."""
    if not (q.is_cuda and supported_store(q, fmt)):
        return reference_store(q, store, fmt, rows, w, visible)
    return _launch(q, store[0], w, visible, scale=store[1] if fmt == "mxfp4" else None, rows=rows, fmt=fmt)


def index_scores_store_per_token(q: torch.Tensor, store: tuple[torch.Tensor, ...], fmt: str, table: torch.Tensor,
                                 token_req: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`index_scores_per_token` against a store in `fmt`; `reference_store_per_token` off CUDA."""
    if not (q.is_cuda and supported_store(q, fmt)):
        return reference_store_per_token(q, store, fmt, table, token_req, w, visible)
    return _launch_per_token(q, store[0], table, token_req, w, visible,
                             scale=store[1] if fmt == "mxfp4" else None, fmt=fmt)


def _launch(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, *, scale=None,
            rows: torch.Tensor | None = None, fmt: str = "bfloat16") -> torch.Tensor:
    """The launch without the device / dtype checks (also runs under TRITON_INTERPRET=1). With
    `rows`, entry e is key row rows[e]; mxfp4: `keys` are the codes, `scale` the scale bytes."""
    T, H, Dh = q.shape
    E = keys.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=q.device)
    if T == 0 or E == 0:
        return out
    keys = keys.contiguous()
    _index_scores_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(E, BLOCK_E))](
        q.contiguous(), keys, keys if scale is None else scale.contiguous(),
        keys if rows is None else rows.contiguous(), w.float().contiguous(), visible.to(torch.int32).contiguous(),
        out, T, E, H, DH=Dh, BT=BLOCK_T, BE=BLOCK_E, FMT=FORMATS[fmt], GATHER=rows is not None,
        num_warps=4, num_stages=2)
    return out
