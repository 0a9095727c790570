"""DeepSeek-V4 attention pieces: compressor, lightning indexer, sparse attention with sinks.

Plain-torch reference path. Each query attends to its window (the last W raw tokens,
itself included) plus a list of compressed entries (indexer top-k for CSA, all visible
for HCA); a learned per-head sink logit joins the softmax denominator only.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import compress_pool as _pool
from deepinfer.kernels import index_scores as _scores
from deepinfer.kernels import index_topk as _topk
from deepinfer.kernels import sparse_attention as _sa_kernel
from deepinfer.kernels.copy_rows import copy_rows
from deepinfer.layers import invariant
from deepinfer.state.forward_batch import CompressPlan, ForwardBatch, to_device
from deepinfer.state.kv_state import CarryState, EntryStore, IndexKeyStore, RowStore
from deepinfer.layers.linear import DENSE, Linear, QuantSpec, stacked_forward
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RopeCache, apply_rope

# elements of gathered keys per query chunk (bounds peak memory of the reference path)
_CHUNK_ELEMS = 1 << 26
SHARED_KEYS_MIN_TOKENS = 16  # indexer: requests with this many tokens in a step score against their keys once


def _chunks(n_tokens: int, per_token: int):
    step = max(1, _CHUNK_ELEMS // max(1, per_token))
    for s in range(0, n_tokens, step):
        yield slice(s, min(n_tokens, s + step))


class Compressor(nn.Module):
    """Softmax-gated pooling of every `ratio` tokens into one entry of width `dim`.

    With overlap (CSA, ratio 4) each token projects 2*dim channels: [:dim] feeds the
    NEXT window's entry, [dim:] its own; entry w pools 2m slots (tokens m(w-1).. mw+m-1).
    Without overlap (HCA) entry w pools tokens mw .. mw+m-1. Entry w is rotated at m*w.
    """

    def __init__(self, in_dim: int, dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(in_dim, width, dtype)
        self.wgate = Linear(in_dim, width, dtype)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, plan: CompressPlan, carry: CarryState,
                rope: RopeCache, gather=None,
                store: RowStore | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Returns (new entries [N, dim] normed + rotated, their addresses); updates carry. `rope`:
        cos/sin at plan.rope_pos (shared by every compressor of the plan's kind in a step). `gather`
        (context parallelism): x holds some rows of the step, the plan indexes all of them; the
        rows' projections are gathered before pooling (StepContext.gather). `store`: where its format
        normalises, rotates and writes in one launch (RowStore.write_normed), the entries are written
        there and None is returned in their place."""
        kv, score = stacked_forward(self, "_wkv_wgate", (self.wkv, self.wgate), x, fp32=True)  # one GEMM on CUDA
        score = score + self.ape[positions % self.ratio]
        if gather is not None:
            kv, score = gather(torch.cat((kv, score), dim=-1)).split(kv.shape[-1], dim=-1)
        if x.is_cuda and _pool.triton is not None:  # one launch; slots reduced in order (batch-invariant)
            pooled = _pool.compress_pool(kv, score, carry.kv, carry.score, plan.src_new, plan.src_carry, self.dim,
                                         self.overlap).to(x.dtype)
            return self._finish(pooled, kv, score, plan, carry, rope, store)
        new, old = plan.src_new, plan.src_carry
        src_kv = torch.where((new >= 0)[..., None], kv[new.clamp(min=0)], carry.kv[old.clamp(min=0)])
        src_score = torch.where((new >= 0)[..., None], score[new.clamp(min=0)], carry.score[old.clamp(min=0)])
        src_score = src_score.masked_fill(((new < 0) & (old < 0))[..., None], float("-inf"))
        if self.overlap:
            m, d = self.ratio, self.dim
            src_kv = torch.cat((src_kv[:, :m, :d], src_kv[:, m:, d:]), dim=1)
            src_score = torch.cat((src_score[:, :m, :d], src_score[:, m:, d:]), dim=1)
        weights = torch.softmax(src_score.transpose(1, 2), dim=-1).transpose(1, 2)  # row-local over the S slots
        pooled = invariant.reduce_sum(weights * src_kv, 1).to(x.dtype)
        return self._finish(pooled, kv, score, plan, carry, rope, store)

    def _finish(self, pooled, kv, score, plan: CompressPlan, carry: CarryState, rope: RopeCache,
                store: RowStore | None):
        copy_rows(((carry.kv, kv), (carry.score, score)), plan.carry_dst, plan.carry_src)  # one launch on CUDA
        if store is not None and store.write_normed(plan.dst, pooled, (self.norm.weight, self.norm.eps, rope.cos,
                                                                       rope.sin)):
            return None, plan.dst
        return apply_rope(self.norm(pooled), rope, overwrite=True), plan.dst


class Indexer(nn.Module):
    """Lightning indexer: score_w = sum_h w_h * relu(q_h . k_w); keep the top-k visible entries."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, ratio: int,
                 eps: float, dtype: torch.dtype, quant: QuantSpec = DENSE):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, dtype, quant)
        self.weights_proj = Linear(dim, n_heads, dtype)
        self.compressor = Compressor(dim, head_dim, ratio, True, eps, dtype)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch, plan: CompressPlan,
                keys: IndexKeyStore, carry: CarryState, rope: RopeCache, entry_rope: RopeCache,
                gather=None, q_proj: torch.Tensor | None = None) -> torch.Tensor:
        """-> [T, k] selected entry ids (ascending score order not guaranteed), -1 = none. `rope`: at
        the tokens' positions (queries); `entry_rope`: at the new entries' (plan.rope_pos); `gather`:
        see Compressor.forward; `q_proj`: wq_b(qr) when the caller computed it (with its own query
        projection, in one GEMM)."""
        new_keys, dst = self.compressor(x, batch.positions, plan, carry, entry_rope, gather)
        keys.write(dst, new_keys)
        q_proj = self.wq_b(qr) if q_proj is None else q_proj
        q = apply_rope(q_proj.view(-1, self.n_heads, self.head_dim), rope, overwrite=True)
        q = keys.prepare_query(q)
        # the fused score kernel: bf16 queries, keys readable in bf16 without rounding
        fused = keys.fmt in ("bfloat16", "fp4") and _scores.supported(q, q)
        q = q if fused else q.float()
        w = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        nv = plan.max_visible
        k = min(self.topk, nv)
        out = torch.full((x.shape[0], k), -1, dtype=torch.long, device=x.device)
        if k == 0:
            return out
        lens, inv = batch.req_lens, invariant.enabled()
        every = inv and x.is_cuda  # invariant mode on CUDA: every request on the fixed-order GEMM path
        rest: list[tuple[int, int]] = []  # (first row, count) of requests left to the per-token path
        t0 = 0
        for r, n in enumerate(lens):
            if every or (n >= SHARED_KEYS_MIN_TOKENS and not inv):
                # a request's tokens share its keys: read once per request, not once per token
                kk = keys.read(plan.addr[r], q.dtype)                             # [nv, Di]
                for sl in _chunks(n, nv if fused else nv * self.n_heads):
                    sl = slice(t0 + sl.start, t0 + sl.stop)
                    if fused:  # one kernel, no [T, H, nv] logits; batch-invariant by construction
                        s = _scores.index_scores(q[sl], kk, w[sl], plan.visible[sl])
                    else:
                        qk = invariant.linear(q[sl], kk) if inv else q[sl].flatten(0, 1) @ kk.t()
                        s = qk.view(-1, self.n_heads, nv).relu_()
                        if inv:
                            s = invariant.reduce_sum(s * w[sl, :, None], 1)      # sum_h w_h * relu(q_h . k)
                        else:
                            s = torch.bmm(w[sl, None, :], s).squeeze(1)
                    out[sl] = self._top(s, plan.visible[sl], k)
            else:
                rest.append((t0, n))
            t0 += n
        if lens and not rest:
            return out
        # per-token path: all tokens (plain slices), or the short requests' rows
        rows = None if not lens or len(rest) == len(lens) else \
            to_device(torch.cat([torch.arange(a, a + n) for a, n in rest]), x.device)
        fp4_kernel = keys.fmt == "fp4" and _scores.supported_store(q, "mxfp4")
        if fused and (keys.fmt == "bfloat16" or fp4_kernel) and not inv:  # CUDA: keys read by address in the kernel
            pick = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: E731
            vis = pick(plan.visible)
            if keys.fmt == "bfloat16":
                s = _scores.index_scores_per_token(pick(q), keys.data, plan.addr, pick(batch.token_req), pick(w), vis)
            else:  # FP4 keys are rows of the kernel's mxfp4 layout (E2M1 pairs, low nibble first; E8M0 per 32)
                s = _scores._launch_per_token(pick(q), keys.packed.view(torch.uint8), plan.addr, pick(batch.token_req),
                                              pick(w), vis, scale=keys.scale, fmt="mxfp4")
            out[slice(None) if rows is None else rows] = self._top(s, vis, k)
            return out
        count = x.shape[0] if rows is None else rows.numel()
        for sl in _chunks(count, nv * self.head_dim):
            idx = sl if rows is None else rows[sl]
            kk = keys.read(plan.addr[batch.token_req[idx]], torch.float32)       # [Tc, nv, Di]
            qs, ws = q[idx].float(), w[idx]
            s = invariant.by_key_blocks(lambda kb: torch.einsum("thc,th->tc", torch.einsum("thd,tcd->thc", qs, kb).relu(),
                                                                ws), kk)
            out[idx] = self._top(s, plan.visible[idx], k)
        return out

    @staticmethod
    def _top(s: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
        """[Tc, nv] scores -> [Tc, k] ids of the k best visible entries, -1 where fewer exist; equal
        scores keep ascending entry order (lowest index first). Short rows on CUDA: one launch."""
        return _topk.index_topk(s, visible, k)


def _kernel_format(store) -> str | None:
    """The store's layout as the kernel names it (kernels/sparse_attention.py FORMATS), or None where
    the kernel does not read it. V4's EntryStore: "bfloat16", "fp8" (nope e4m3 + bf16 rope); V4.1's
    FormatStore (any other store): "bfloat16", "fp8" -> "v41fp8" (e4m3, E8M0 per 32), "nvfp4"."""
    if store is None:
        return None
    if isinstance(store, EntryStore):
        return store.fmt if store.fmt in ("bfloat16", "fp8") else None
    return {"bfloat16": "bfloat16", "fp8": "v41fp8", "nvfp4": "nvfp4"}.get(store.fmt)


DECODE_ONCE_READS = 4  # a quantised store is decoded up front when each decoded row is read >= this often


def decoded_once(ring, ring_fmt: str, ring_reads: int, entries, ent_fmt: str | None, ent_reads: int,
                 table: torch.Tensor | None):
    """The stores the sparse-attention kernel reads, with a quantised one replaced by a bf16 copy where
    that is cheaper than decoding in the kernel: the copy costs one decode per row, the kernel decodes a
    row at every read (per token and head block), so prefill steps (thousands of tokens sharing a window
    ring and a request's entries) gain and decode steps do not. Copies are exact: every stored value is a
    bf16 (e4m3 / e2m1 codes times power-of-two or e4m3 scales), decoded as the kernel decodes it.
    `*_reads`: the rows the kernel would read (tokens x window, tokens x entry ids); `table` [B, V]: the
    entries' addresses (plan.addr). The whole ring is copied (its rows per slot are not known here);
    entries only at the addresses in `table`, which then becomes the copy's row numbers (-1 kept).
    -> ((ring tensors, ring format), (entry tensors, entry format, table))."""
    ring_t = tuple(ring.tensors())
    rows = ring_t[0].shape[0]
    if _sa_kernel.FORMATS[ring_fmt][0] and rows * DECODE_ONCE_READS <= ring_reads:
        ring_t, ring_fmt = (ring.read(torch.arange(rows, device=ring_t[0].device), torch.bfloat16),), "bfloat16"
    if entries is None:
        return (ring_t, ring_fmt), (None, ent_fmt, table)
    ent_t = tuple(entries.tensors())
    if _sa_kernel.FORMATS[ent_fmt][0] and table.numel() * DECODE_ONCE_READS <= ent_reads:
        ent_t, ent_fmt = (entries.read(table.clamp(min=0).flatten(), torch.bfloat16),), "bfloat16"
        copy_rows_of = torch.arange(table.numel(), device=table.device, dtype=table.dtype).view_as(table)
        table = torch.where(table >= 0, copy_rows_of, -1)
    return (ring_t, ring_fmt), (ent_t, ent_fmt, table)


def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, batch: ForwardBatch, ring: EntryStore,
                     entry_ids: torch.Tensor | None, plan: CompressPlan | None, entries: EntryStore | None,
                     sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; window keys from this step's kv or the ring, plus entries `entry_ids`
    [T, K] (-1 = none) of the layer's compressed pool. K == V. Returns [T, H, D].
    CUDA + bf16 + stores the kernel reads (`_kernel_format`: bf16, V4's fp8, V4.1's fp8 window and nvfp4
    entries, decoded in its registers): the Triton kernel (deepinfer.kernels.sparse_attention); else torch."""
    has_ent = entry_ids is not None and entry_ids.shape[1] > 0
    ring_fmt, ent_fmt = _kernel_format(ring), _kernel_format(entries) if has_ent else None
    if (q.is_cuda and _sa_kernel.triton is not None and q.dtype == torch.bfloat16 and ring_fmt is not None
            and (not has_ent or ent_fmt is not None)
            and _sa_kernel.supported(q, kv_new, ring_fmt, ent_fmt, has_ent)):
        ring_t, ent_t = tuple(ring.tensors()), tuple(entries.tensors()) if has_ent else None
        table = plan.addr if has_ent else None
        if not invariant.enabled():  # invariant mode keeps one kernel path for every step shape
            (ring_t, ring_fmt), (ent_t, ent_fmt, table) = decoded_once(ring, ring_fmt, batch.win_new.numel(),
                                                                        entries if has_ent else None, ent_fmt,
                                                                        entry_ids.numel() if has_ent else 0, table)
        # entry ids go in as they are: the kernel reads their addresses from `table` itself
        return _sa_kernel.sparse_attention(q, kv_new, batch.win_new, batch.win_ring, ring_t, ring_fmt,
                                           entry_ids if has_ent else None, ent_t, ent_fmt, sinks, scale,
                                           **invariant.attention_tiles(),
                                           indirect=(batch.token_req, table) if has_ent else None)
    T, H, D = q.shape
    out = torch.empty_like(q)
    n_keys = batch.win_new.shape[1] + (entry_ids.shape[1] if entry_ids is not None else 0)
    for sl in _chunks(T, n_keys * D):
        new, old = batch.win_new[sl], batch.win_ring[sl]
        keys = torch.where((new >= 0)[..., None], kv_new[new.clamp(min=0)].float(),
                           ring.read(old.clamp(min=0), torch.float32))
        valid = (new >= 0) | (old >= 0)
        if entry_ids is not None and entry_ids.shape[1]:
            ids = entry_ids[sl]
            addr = plan.addr[batch.token_req[sl, None], ids.clamp(min=0)]
            keys = torch.cat((keys, entries.read(addr, torch.float32)), dim=1)
            valid = torch.cat((valid, ids >= 0), dim=1)
        out[sl] = (invariant.attend if invariant.enabled() else _sa_kernel.attend)(q[sl], keys, valid, sinks, scale)
    return out
