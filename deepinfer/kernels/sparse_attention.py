"""DeepSeek-V4 sparse attention with sinks: one shared KV head (K == V), head_dim D.

For query token t, head h (q [T, H, D]) the keys are
  window j = 0..W-1:  kv_new[win_new[t, j]]   if win_new[t, j] >= 0   (this step's kv, q's dtype)
                      ring row win_ring[t, j] elif win_ring[t, j] >= 0 (else absent)
  entry  k = 0..K-1:  entries row entry_addr[t, k] if >= 0              (else absent)
  s_n  = scale * q[t, h] . key_n           (fp32)
  out  = sum_n exp(s_n) key_n / (sum_n exp(s_n) + exp(sinks[h]))
The sink only joins the denominator, so a token without any valid key gets 0.

Stores are passed as their `tensors()`, in one of these formats (ring and entries independently):
  "bfloat16" / "float32": (data [R, D],)                       V4's EntryStore and V4.1's FormatStore
  "fp8":    (nope_q e4m3 [R, nope], nope_scale uint8 [R, nope / group], rope bf16 [R, D - nope]),
            key = cat(nope_q * 2^(nope_scale - 127), rope) (E8M0 scale per group of columns)  V4's EntryStore
  "v41fp8": (codes e4m3 [R, D], scale uint8 [R, D / 32]), key = codes * 2^(scale - 127) per group of
            32 columns                                          V4.1's FormatStore "fp8" (formats/group_quant)
  "nvfp4":  (codes uint8 [R, D / 2], scale e4m3 [R, D / 16]), two E2M1 codes a byte (even column in the
            low nibble), key = e2m1 * scale per group of 16     V4.1's FormatStore "nvfp4"

Kernel: grid (T, cdiv(H, BLOCK_H), splits). All heads share the KV head, so a program gathers a
tile of BLOCK_N key rows once (window tiles first, then entry tiles), decodes it to q's dtype and
uses it for BLOCK_H heads: logits = q_tile [BLOCK_H, D] @ k^T, online softmax in the exp2 domain,
acc += P @ k. Invariants:
  * the running max starts at the sink logit (and the running sum at exp(0) = 1 on split 0), so the
    max is always finite, exp2 never overflows, masked keys give exactly 0, and a keyless token
    ends with acc = 0, l = 1 -> out 0 (no NaN). Sinks must be finite.
  * the quantised stores are never copied: a tile's key rows are decoded in registers (fp32
    product code * scale, then q's dtype) right before its dots.
  * dots run in q's dtype with fp32 accumulation: bf16 q -> bf16 keys, P rounded to bf16 for the
    P @ V dot (the only rounding vs `reference`); fp32 q -> fp32 keys and IEEE fp32 dots (matches
    `reference` to ~1e-6). bf16 q with a float32 store is not supported by the kernel (the launcher
    uses `reference`). Decoded keys are exact in bf16, so bf16 keys round nothing:
      fp8 / v41fp8: e4m3 (<= 4 significant bits) * 2^k, a normal bf16 for every value the encoders
      write (V4.1's fp8 scale is >= 2^-22: |nonzero key| >= 2^-31);
      nvfp4: e2m1 (<= 2 significant bits: 0.5 .. 6) * e4m3 (<= 4 bits, >= 2^-9) has <= 6 significant
      bits and 2^-10 <= |nonzero key| <= 6 * 448, inside bf16's normal range (8 significant bits).
    The fp32 products are exact too, so `reference` (fp32 decode) sees the same key values.
  * an E8M0 byte s decodes as the fp32 with exponent bits s (2^(s-127) for s >= 1; s = 0 -> 0
    instead of 2^-127, which only matters for |values| < 2^-118; V4.1's encoder never writes 0).
  * E2M1 decodes arithmetically: magnitude code m = 2e + b -> m / 2 for e = 0, else the fp32 with
    exponent e - 1 and mantissa b / 2; bit 3 is the sign.
  * D must be a power of two >= 16 (Triton block shapes); >= 32 for v41fp8. A quantised key tile is
    gathered as [BLOCK_N, D / group, group] (one scale load per row and group), then flattened to
    [BLOCK_N, D]. fp8: nope need not be a power of two (448 in V4-Flash); the group (gcd(64, nope), a
    power of two) divides nope and D: groups < nope / group from nope_q, the rest from rope, by masks.
  * the two fp8 stores of one call (ring, entries) share nope / group / rope widths.
  * a tile with no valid key is skipped: it would leave (m, l, acc) bit-for-bit unchanged (alpha =
    exp2(0) = 1, p = 0), so skipping changes no bits; it pays when -1s come in runs (top-k lists end
    with them, prompt starts have short windows).
Split-KV (decode, few programs): split s takes its share of the window tiles and of the entry
tiles and writes (acc, m, l) in fp32; a second kernel merges the splits (sink counted by split 0).
Batch-invariant mode uses fixed splits instead (`_launch`, tiles_per_split): their boundaries do not
move with the padded entry width, and they are folded in split order.
Tiles: `default_config` per token count, measured on the H200. Wide head blocks (32 / 64 heads)
spill registers at D = 512 (the q operand is held across the whole contraction) yet win at prefill
with 8 warps, where key loads, not registers, bound the kernel.
"""
from __future__ import annotations

import torch

from deepinfer.formats import group_quant
from deepinfer.kernels import sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

LOG2E = 1.4426950408889634
_CHUNK_ELEMS = 1 << 26  # gathered key elements per query chunk in `reference`


# kernel format name -> (its code in the kernel, V4.1 group_quant format); exact formats are code 0
FORMATS = {"bfloat16": (0, None), "float32": (0, None), "fp8": (1, None), "v41fp8": (2, "fp8"),
           "nvfp4": (3, "nvfp4")}


def _decode(store: tuple[torch.Tensor, ...], fmt: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a store as fp32 (same arithmetic as EntryStore / FormatStore .read(rows, torch.float32))."""
    if FORMATS[fmt][1] is not None:
        codes, scale = store
        return group_quant.decode(codes[rows], scale[rows], FORMATS[fmt][1], torch.float32)
    if fmt == "fp8":
        nope_q, nope_scale, rope = store
        group = nope_q.shape[1] // nope_scale.shape[1]
        s = torch.exp2(nope_scale[rows].float() - 127).unsqueeze(-1)
        nope = (nope_q[rows].float().unflatten(-1, (-1, group)) * s).flatten(-2)
        return torch.cat((nope, rope[rows].float()), dim=-1)
    return store[0][rows].float()


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D] against each token's gathered keys [T, K, D] (fp32; K == V), masked by valid
    [T, K]; the sink logit joins the softmax denominator only. fp32 math, q's dtype out."""
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


def reference(q: torch.Tensor, kv_new: torch.Tensor, win_new: torch.Tensor, win_ring: torch.Tensor,
              ring: tuple[torch.Tensor, ...], ring_fmt: str, entry_addr: torch.Tensor | None,
              entries: tuple[torch.Tensor, ...] | None, entries_fmt: str | None, sinks: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [T, H, D], kv_new [Tn, D], win_new / win_ring [T, W], entry_addr [T, K] pool rows (-1 = none)
    -> [T, H, D] in q's dtype; all math in fp32."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    has_ent = entry_addr is not None and entry_addr.shape[1] > 0
    n_keys = win_new.shape[1] + (entry_addr.shape[1] if has_ent else 0)
    step = max(1, _CHUNK_ELEMS // max(1, n_keys * D))
    for s0 in range(0, T, step):
        sl = slice(s0, min(T, s0 + step))
        new, old = win_new[sl], win_ring[sl]
        keys = torch.where((new >= 0)[..., None], kv_new[new.clamp(min=0)].float(),
                           _decode(ring, ring_fmt, old.clamp(min=0)))
        valid = (new >= 0) | (old >= 0)
        if has_ent:
            addr = entry_addr[sl]
            keys = torch.cat((keys, _decode(entries, entries_fmt, addr.clamp(min=0))), dim=1)
            valid = torch.cat((valid, addr >= 0), dim=1)
        out[sl] = attend(q[sl], keys, valid, sinks, scale)
    return out


if triton is not None:
    # format codes (FORMATS) and V4.1's group widths (formats/group_quant.GROUP), as compile-time constants
    _FP8: tl.constexpr = tl.constexpr(FORMATS["fp8"][0])
    _V41FP8: tl.constexpr = tl.constexpr(FORMATS["v41fp8"][0])
    _NVFP4: tl.constexpr = tl.constexpr(FORMATS["nvfp4"][0])
    _V41FP8_GROUP: tl.constexpr = tl.constexpr(group_quant.GROUP["fp8"])
    _NVFP4_GROUP: tl.constexpr = tl.constexpr(group_quant.GROUP["nvfp4"])

    @triton.jit
    def _e8m0_groups(codes, scales, rows, ok, ROW_CODES: tl.constexpr, NG: tl.constexpr, D: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        """e4m3 codes [R, ROW_CODES] with E8M0 bytes [R, NG] (one per GROUP columns) -> fp32
        [BLOCK_N, D / GROUP, GROUP] tile: code * 2^(byte - 127) in groups < NG, 0 in the rest and where ~ok."""
        g = tl.arange(0, D // GROUP)
        col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                   # [D/G, G]
        g_ok = g < NG
        v = tl.load(codes + rows[:, None, None] * ROW_CODES + col[None], mask=ok[:, None, None] & g_ok[None, :, None],
                    other=0.0).to(tl.float32)
        sc = tl.load(scales + rows[:, None] * NG + g[None, :], mask=ok[:, None] & g_ok[None, :], other=0)
        return v * (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None]  # E8M0 -> 2^(s-127)

    @triton.jit
    def _e2m1(code):
        """E2M1 codes (int32, 0..15) -> fp32 values (0, 0.5, 1, 1.5, 2, 3, 4, 6, then negated)."""
        mag = code & 7
        normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)                      # 2^(e-1) * (1 + b/2)
        v = tl.where(mag >= 2, normal.to(tl.float32, bitcast=True), mag.to(tl.float32) * 0.5)
        return tl.where((code & 8) != 0, -v, v)

    @triton.jit
    def _gather_keys(rows, ok, t0, t1, t2, FMT: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, KDT: tl.constexpr):
        """rows [BLOCK_N] (anything where ~ok) -> key rows [BLOCK_N, D] in KDT, 0 where ~ok; decoded in
        registers from the store format FMT (t0, t1, t2 = the store's tensors)."""
        if FMT == _FP8:  # nope groups from t0 / t1, rope columns from t2
            v = _e8m0_groups(t0, t1, rows, ok, NOPE, NOPE // GROUP, D, GROUP, BLOCK_N)
            g = tl.arange(0, D // GROUP)
            col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                   # [D/G, G]
            is_nope = (g < NOPE // GROUP)[None, :, None]
            r = tl.load(t2 + rows[:, None, None] * (D - NOPE) + (col - NOPE)[None], mask=ok[:, None, None] & ~is_nope,
                        other=0.0)
            k = tl.reshape(tl.where(is_nope, v, r.to(tl.float32)), [BLOCK_N, D]).to(KDT)
        elif FMT == _V41FP8:
            v = _e8m0_groups(t0, t1, rows, ok, D, D // _V41FP8_GROUP, D, _V41FP8_GROUP, BLOCK_N)
            k = tl.reshape(v, [BLOCK_N, D]).to(KDT)
        elif FMT == _NVFP4:  # byte col // 2 holds column col (even: low nibble); one e4m3 scale per group
            G: tl.constexpr = _NVFP4_GROUP
            g = tl.arange(0, D // G)
            col = g[:, None] * G + tl.arange(0, G)[None, :]                           # [D/G, G]
            b = tl.load(t0 + rows[:, None, None] * (D // 2) + (col // 2)[None], mask=ok[:, None, None], other=0)
            code = (b.to(tl.int32) >> ((col & 1) * 4)[None]) & 15
            sc = tl.load(t1 + rows[:, None] * (D // G) + g[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            k = tl.reshape(_e2m1(code) * sc[:, :, None], [BLOCK_N, D]).to(KDT)
        else:
            c = tl.arange(0, D)
            k = tl.load(t0 + rows[:, None] * D + c[None, :], mask=ok[:, None], other=0.0).to(KDT)
        return k

    @triton.jit
    def _softmax_step(q, k, ok, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
        """One key tile of the online softmax (log2 domain; qk_scale has log2(e) folded in)."""
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale                # [BH, BN] fp32
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                                   # finite (>= sink)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _attend(q, t, c, j, kvn_ptr, wnew_ptr, wring_ptr, r0, r1, r2, addr_ptr, paddr_row, e0, e1, e2, W, K,
                qk_scale, w_lo, w_hi, e_lo, e_hi, m_i, l_i, acc, D: tl.constexpr, NOPE: tl.constexpr,
                GROUP: tl.constexpr, RING_FMT: tl.constexpr, ENT_FMT: tl.constexpr, HAS_ENT: tl.constexpr,
                BLOCK_N: tl.constexpr, KDT: tl.constexpr, PREC: tl.constexpr, INDIRECT: tl.constexpr):
        """Window key tiles [w_lo, w_hi) then entry tiles [e_lo, e_hi) of token t into (m, l, acc).
        INDIRECT: addr_ptr holds entry ids, translated through the token's request row paddr_row."""
        for i in range(w_lo, w_hi):                                                   # window keys
            n = i * BLOCK_N + j
            new = tl.load(wnew_ptr + t * W + n, mask=n < W, other=-1)
            old = tl.load(wring_ptr + t * W + n, mask=n < W, other=-1)
            is_new = new >= 0
            ok = is_new | (old >= 0)
            if tl.max(ok.to(tl.int32), axis=0) > 0:  # a keyless tile would add exactly nothing
                k_new = tl.load(kvn_ptr + new[:, None] * D + c[None, :], mask=is_new[:, None], other=0.0)
                k_old = _gather_keys(old, (old >= 0) & ~is_new, r0, r1, r2, RING_FMT, D, NOPE, GROUP, BLOCK_N,
                                     KDT)
                k = tl.where(is_new[:, None], k_new.to(KDT), k_old)
                m_i, l_i, acc = _softmax_step(q, k, ok, m_i, l_i, acc, qk_scale, PREC)
        if HAS_ENT:
            for i in range(e_lo, e_hi):                                               # compressed entries
                n = i * BLOCK_N + j
                rows = tl.load(addr_ptr + t * K + n, mask=n < K, other=-1)
                if INDIRECT:  # entry id -> its address in the request's table (-1 stays -1)
                    rows = tl.load(paddr_row + rows, mask=rows >= 0, other=-1)
                if tl.max(rows, axis=0) >= 0:  # top-k lists put their -1s last: whole tiles drop out
                    k = _gather_keys(rows, rows >= 0, e0, e1, e2, ENT_FMT, D, NOPE, GROUP, BLOCK_N, KDT)
                    m_i, l_i, acc = _softmax_step(q, k, rows >= 0, m_i, l_i, acc, qk_scale, PREC)
        return m_i, l_i, acc

    @triton.jit
    def _merge(M, L, A, m, l, a):
        """Fold split (m, l, a) into the running (M, L, A); explicit fmas, so every kernel that merges
        rounds alike. An empty split (m = sink logit <= M, l = 0, a = 0) leaves (M, L, A) unchanged."""
        M_new = tl.maximum(M, m)
        alpha = tl.exp2(M - M_new)
        beta = tl.exp2(m - M_new)
        return M_new, tl.fma(L, alpha, l * beta), tl.fma(A, alpha[:, None], a * beta[:, None])

    @triton.jit
    def _sparse_attn_kernel(q_ptr, kvn_ptr, wnew_ptr, wring_ptr, r0, r1, r2, addr_ptr, req_ptr, paddr_ptr, e0, e1,
                            e2, sink_ptr, out_ptr, part_ptr, ml_ptr, H, W, K, stride_pa, qk_scale,
                            D: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr,
                            RING_FMT: tl.constexpr, ENT_FMT: tl.constexpr, HAS_ENT: tl.constexpr,
                            SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                            TPS: tl.constexpr, SEQ: tl.constexpr, INDIRECT: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(2)
        KDT: tl.constexpr = q_ptr.dtype.element_ty
        PREC: tl.constexpr = "ieee" if KDT == tl.float32 else "tf32"
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < H
        c = tl.arange(0, D)
        qrow = t * H + heads                                                          # [BH] int64
        q = tl.load(q_ptr + qrow[:, None] * D + c[None, :], mask=h_ok[:, None], other=0.0)
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = sink
        l_i = tl.zeros([BLOCK_H], tl.float32) + tl.where(sp == 0, 1.0, 0.0)          # exp2(sink - m_i)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        j = tl.arange(0, BLOCK_N)
        n_w = tl.cdiv(W, BLOCK_N)
        n_e = tl.cdiv(K, BLOCK_N)
        if INDIRECT:
            paddr_row = paddr_ptr + tl.load(req_ptr + t) * stride_pa
        else:
            paddr_row = addr_ptr
        if TPS == 0:  # balanced: split sp takes its share of the window tiles and of the entry tiles
            m_i, l_i, acc = _attend(q, t, c, j, kvn_ptr, wnew_ptr, wring_ptr, r0, r1, r2, addr_ptr, paddr_row,
                                    e0, e1, e2, W, K, qk_scale, sp * n_w // SPLITS, (sp + 1) * n_w // SPLITS,
                                    sp * n_e // SPLITS, (sp + 1) * n_e // SPLITS, m_i, l_i, acc, D, NOPE, GROUP,
                                    RING_FMT, ENT_FMT, HAS_ENT, BLOCK_N, KDT, PREC, INDIRECT)
        else:
            # fixed splits (batch-invariant): split 0 = the window, split s >= 1 = entry tiles
            # [(s - 1) * TPS, s * TPS); a wider (padded) entry list only adds empty splits
            if SEQ:  # every split in this program, folded in split order as `_merge_splits_kernel` does
                m_i, l_i, acc = _attend(q, t, c, j, kvn_ptr, wnew_ptr, wring_ptr, r0, r1, r2, addr_ptr,
                                        paddr_row, e0, e1, e2, W, K, qk_scale, 0, n_w, 0, 0, m_i, l_i, acc, D,
                                        NOPE, GROUP,
                                        RING_FMT, ENT_FMT, HAS_ENT, BLOCK_N, KDT, PREC, INDIRECT)
                for s in range(0, tl.cdiv(n_e, TPS)):
                    m_s, l_s, a_s = _attend(q, t, c, j, kvn_ptr, wnew_ptr, wring_ptr, r0, r1, r2, addr_ptr,
                                            paddr_row, e0, e1, e2, W, K, qk_scale, 0, 0, s * TPS,
                                            tl.minimum((s + 1) * TPS, n_e),
                                            sink, tl.zeros([BLOCK_H], tl.float32),
                                            tl.zeros([BLOCK_H, D], tl.float32), D, NOPE, GROUP, RING_FMT,
                                            ENT_FMT, HAS_ENT, BLOCK_N, KDT, PREC, INDIRECT)
                    m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, a_s)
            else:  # this program is split sp
                e_lo = tl.maximum(sp - 1, 0) * TPS
                m_i, l_i, acc = _attend(q, t, c, j, kvn_ptr, wnew_ptr, wring_ptr, r0, r1, r2, addr_ptr,
                                        paddr_row, e0, e1, e2, W, K, qk_scale, 0, tl.where(sp == 0, n_w, 0), e_lo,
                                        tl.where(sp == 0, 0, tl.minimum(e_lo + TPS, n_e)), m_i, l_i, acc, D, NOPE,
                                        GROUP, RING_FMT, ENT_FMT, HAS_ENT, BLOCK_N, KDT, PREC, INDIRECT)

        if SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(out_ptr + qrow[:, None] * D + c[None, :], o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
        else:  # partials [T, H, SPLITS, D] and (m, l) [T, H, SPLITS, 2]
            prow = qrow * SPLITS + sp
            tl.store(part_ptr + prow[:, None] * D + c[None, :], acc, mask=h_ok[:, None])
            tl.store(ml_ptr + prow * 2, m_i, mask=h_ok)
            tl.store(ml_ptr + prow * 2 + 1, l_i, mask=h_ok)

    @triton.jit
    def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, SPLITS: tl.constexpr, SP2: tl.constexpr,
                             D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)                                           # t * H + h
        s = tl.arange(0, SP2)
        s_ok = s < SPLITS
        m = tl.load(ml_ptr + (row * SPLITS + s) * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1, mask=s_ok, other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0))
        c = tl.arange(0, D)
        a = tl.load(part_ptr + (row * SPLITS + s)[:, None] * D + c[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(a * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
        tl.store(out_ptr + row * D + c, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _merge_in_order_kernel(part_ptr, ml_ptr, out_ptr, SPLITS: tl.constexpr, D: tl.constexpr):
        """Fixed splits: fold split 1, 2, ... into split 0 one at a time (`_merge`), as the SEQ kernel
        does in registers, so both give the same bits."""
        row = tl.program_id(0).to(tl.int64)                                           # t * H + h
        c = tl.arange(0, D)
        base = row * SPLITS
        M = tl.load(ml_ptr + base * 2 + tl.zeros([1], tl.int64))
        L = tl.load(ml_ptr + base * 2 + 1 + tl.zeros([1], tl.int64))
        A = tl.load(part_ptr + base * D + c)[None, :]
        for s in range(1, SPLITS):
            m = tl.load(ml_ptr + (base + s) * 2 + tl.zeros([1], tl.int64))
            l_s = tl.load(ml_ptr + (base + s) * 2 + 1 + tl.zeros([1], tl.int64))
            a = tl.load(part_ptr + (base + s) * D + c)[None, :]
            M, L, A = _merge(M, L, A, m, l_s, a)
        o = A / L[:, None]
        tl.store(out_ptr + row * D + c[None, :], o.to(out_ptr.dtype.element_ty))


def entry_addresses(ids: torch.Tensor, token_req: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[T, K] entry ids (-1 = none) -> their addresses table[token_req[t], id] (-1 kept)."""
    return torch.where(ids >= 0, table[token_req[:, None], ids.clamp(min=0)], -1)


def supported(q: torch.Tensor, kv_new: torch.Tensor, ring_fmt: str, entries_fmt: str | None,
              has_entries: bool) -> bool:
    """Whether the kernel handles these dtypes / formats / head_dim (else `reference` is used): bf16 q
    and kv_new, D a power of two >= 16 and a multiple of each V4.1 format's group, stores in any of
    FORMATS but float32.
    Compiled launches take bf16 q only: the fp32-q variant (IEEE dots) is exercised in the Triton
    interpreter, but compiled it does not match the reference closely enough at D = 512
    (benchmarks/NOTES.md), so fp32 stays on torch."""
    D = q.shape[-1]
    fmts = [ring_fmt] + ([entries_fmt] if has_entries else [])
    return (q.dtype == torch.bfloat16 and kv_new.dtype == q.dtype and D >= 16 and D & (D - 1) == 0
            and all(f in FORMATS and f != "float32" and D % _group(f) == 0 for f in fmts))


def _group(fmt: str) -> int:
    """Columns per scale of a V4.1 format (1 for the others)."""
    return group_quant.GROUP[FORMATS[fmt][1]] if FORMATS[fmt][1] is not None else 1


def default_splits(T: int, H: int, n_tiles: int, block_h: int, device: torch.device) -> int:
    """Split the keys only when (tokens x head blocks) leaves most SMs idle (decode)."""
    programs = T * -(-H // block_h)
    sms = sm_count(device) if device.type == "cuda" else 1
    if 2 * programs > sms:
        return 1
    return max(1, min(sms // programs, 4, n_tiles))  # more than 4 splits was slower at batch 1


def default_config(T: int, quantised: bool = False) -> dict:
    """(block_h heads, block_n keys, warps, stages) per token count: the best of the H200 sweeps at
    H = 64, D = 512 with bf16 keys (benchmarks/kernel_sweep.py; numbers in benchmarks/NOTES.md):
    prefill 64 / 32 / 8 warps, decode batch 64 32 / 64 / 8 warps, batch 1 16 heads (with key splits).
    fp8 keys need more registers and shared memory per tile (32 x 64 tiles fail on the H200): 32 heads x 32
    keys, 8 warps, 1 stage, the largest fp8 tiling the GPU tests cover; V4.1's quantised formats
    (`quantised`: any store not exact) take the same tiles."""
    if quantised and T >= 32:
        return dict(block_h=32, block_n=32, num_warps=8, num_stages=1)
    if T >= 1024:
        return dict(block_h=64, block_n=32, num_warps=8, num_stages=2)
    if T >= 32:
        return dict(block_h=32, block_n=64, num_warps=8, num_stages=2)
    return dict(block_h=16, block_n=32, num_warps=8, num_stages=2)


def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, win_new: torch.Tensor, win_ring: torch.Tensor,
                     ring: tuple[torch.Tensor, ...], ring_fmt: str, entry_addr: torch.Tensor | None,
                     entries: tuple[torch.Tensor, ...] | None, entries_fmt: str | None, sinks: torch.Tensor,
                     scale: float, *, block_h: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     num_splits: int | None = None, tiles_per_split: int = 0,
                     indirect: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Triton on CUDA for supported inputs (see `supported`), `reference` otherwise; same contract.
    indirect = (token_req [T], table [B, V]): entry_addr holds entry ids (-1 = none) that the kernel
    translates itself, address = table[token_req[t], id] (saves the host-side gather's launches).

    Tuning (defaults chosen for H = 64, D = 512 on sm_90 so that nothing spills): block_h heads per
    program (>= 16; capped at next_pow2(H)), block_n keys per tile (>= 16; default 32 for bf16 q,
    16 for fp32 q), num_warps, num_stages (software pipelining of the key loads; default 2 for bf16,
    1 for fp32), num_splits key splits per (token, head block) (None: `default_splits`).
    tiles_per_split > 0 (batch-invariant mode): fixed splits instead (see `_launch`); num_splits
    is then ignored."""
    has_ent = entry_addr is not None and entry_addr.shape[1] > 0
    if triton is None or not q.is_cuda or not supported(q, kv_new, ring_fmt, entries_fmt, has_ent):
        if indirect is not None and has_ent:
            entry_addr = entry_addresses(entry_addr, *indirect)
        return reference(q, kv_new, win_new, win_ring, ring, ring_fmt, entry_addr, entries, entries_fmt, sinks,
                         scale)
    quantised = FORMATS[ring_fmt][0] > 0 or (has_ent and FORMATS[entries_fmt][0] > 0)
    cfg = default_config(q.shape[0], quantised)
    return _launch(q, kv_new, win_new, win_ring, ring, ring_fmt, entry_addr, entries, entries_fmt, sinks, scale,
                   block_h=block_h or cfg["block_h"], block_n=block_n or cfg["block_n"],
                   num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
                   num_splits=num_splits, tiles_per_split=tiles_per_split, indirect=indirect)


def _launch(q, kv_new, win_new, win_ring, ring, ring_fmt, entry_addr, entries, entries_fmt, sinks, scale, *,
            block_h: int = 16, block_n: int | None = None, num_warps: int = 8, num_stages: int | None = None,
            num_splits: int | None = None, tiles_per_split: int = 0, split_programs: bool | None = None,
            indirect: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The kernel launch without the device / support checks (also runs under TRITON_INTERPRET=1).

    tiles_per_split > 0: fixed splits, a token's split boundaries depending on nothing but the
    position of its keys: split 0 = the window, split s >= 1 = entry tiles (s - 1) * tps .. s * tps - 1.
    With few programs (decode; or split_programs=True) each split is a program and a second kernel
    folds splits 1, 2, ... into split 0 in order; otherwise (split_programs=False) one program runs
    the splits in order and folds them in registers the same way. Both give the same bits, whatever
    the padded entry width (the extra splits are empty and fold in as exact no-ops)."""
    T, H, D = q.shape
    W = win_new.shape[1]
    has_ent = entry_addr is not None and entry_addr.shape[1] > 0
    K = entry_addr.shape[1] if has_ent else 0
    out = torch.empty_like(q)
    if T == 0:
        return out
    fp32 = q.dtype == torch.float32
    block_h = max(16, min(block_h, triton.next_power_of_2(H)))
    block_n = max(16, block_n or (16 if fp32 else 32))
    num_stages = num_stages or (1 if fp32 else 2)
    q, kv_new = q.contiguous(), kv_new.contiguous()
    win_new, win_ring = win_new.contiguous(), win_ring.contiguous()
    ring = tuple(t.contiguous() for t in ring)
    ent = tuple(t.contiguous() for t in entries) if has_ent else ring
    ent_fmt = entries_fmt if has_ent else ring_fmt
    nope, group = D, 1
    for tensors, fmt in ((ring, ring_fmt), (ent, ent_fmt)):
        if fmt == "fp8":
            nope, group = tensors[0].shape[1], tensors[0].shape[1] // tensors[1].shape[1]
    for tensors, fmt in ((ring, ring_fmt), (ent, ent_fmt)):
        if fmt == "fp8" and (tensors[0].shape[1] != nope or tensors[1].shape[1] * group != nope
                             or tensors[2].shape[1] != D - nope):
            raise ValueError("fp8 stores of one call must share nope / group / rope widths")
    if group & (group - 1) or D % group:
        raise ValueError(f"fp8 group {group} must be a power of two dividing head_dim {D}")
    for tensors, fmt in ((ring, ring_fmt), (ent, ent_fmt)):
        if FORMATS[fmt][1] is not None:
            g = _group(fmt)
            width = D if fmt == "v41fp8" else D // 2
            if D % g or tensors[0].shape[1] != width or tensors[1].shape[1] != D // g:
                raise ValueError(f"{fmt} store of codes {tuple(tensors[0].shape)} and scales "
                                 f"{tuple(tensors[1].shape)} does not hold head_dim {D}")
    r = ring + (ring[0],) * (3 - len(ring))
    e = ent + (ent[0],) * (3 - len(ent))
    addr = entry_addr.contiguous() if has_ent else win_new
    indirect = indirect if has_ent else None
    req, paddr = (indirect[0].contiguous(), indirect[1].contiguous()) if indirect is not None else (addr, addr)
    n_tiles = triton.cdiv(W, block_n) + triton.cdiv(K, block_n)
    tps, seq = tiles_per_split, False
    if tps:
        if split_programs is None:
            sms = sm_count(q.device) if q.device.type == "cuda" else 1
            split_programs = 2 * T * triton.cdiv(H, block_h) <= sms
        splits = 1 + triton.cdiv(triton.cdiv(K, block_n), tps) if split_programs else 1
        seq = not split_programs
    else:
        splits = num_splits or default_splits(T, H, n_tiles, block_h, q.device)
        splits = max(1, min(splits, max(1, n_tiles)))
    if splits > 1:
        part = torch.empty(T, H, splits, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(T, H, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    grid = (T, triton.cdiv(H, block_h), splits)
    _sparse_attn_kernel[grid](q, kv_new, win_new, win_ring, r[0], r[1], r[2], addr, req, paddr, e[0], e[1], e[2],
                              sinks.contiguous(), out, part, ml, H, W, K, paddr.stride(0), float(scale) * LOG2E,
                              D=D, NOPE=nope, GROUP=group, RING_FMT=FORMATS[ring_fmt][0], ENT_FMT=FORMATS[ent_fmt][0],
                              HAS_ENT=has_ent, SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, TPS=tps, SEQ=seq,
                              INDIRECT=indirect is not None,
                              num_warps=num_warps, num_stages=num_stages)
    if splits > 1 and tps:
        _merge_in_order_kernel[(T * H,)](part, ml, out, SPLITS=splits, D=D, num_warps=4)
    elif splits > 1:
        _merge_splits_kernel[(T * H,)](part, ml, out, SPLITS=splits, SP2=triton.next_power_of_2(splits), D=D,
                                       num_warps=4)
    return out

