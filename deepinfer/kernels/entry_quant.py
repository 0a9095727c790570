"""The FP8 cache entries' format (EntryStore fmt "fp8") in one kernel: encode, optionally scattered
straight into the store's rows, and the write-then-read round trip.

For x [..., dim] (bf16 / fp16 / fp32) with nope = dim - rope_dim and g = gcd(64, nope):
    encode:    (q [..., nope] e4m3, scale [..., nope / g] uint8, rope [..., rope_dim] bf16)   (`reference`)
               per group of g nope dims: e = clamp(ceil(log2(max(amax, 1e-30) / 448)), -127, 127),
               q = e4m3(x / 2^e) (round to nearest even), scale byte e + 127; rope dims -> bf16
    decode:    [..., dim] = cat(q * 2^(byte - 127) in fp32, rope) -> dtype             (`reference_decode`)
    roundtrip: decode(encode(x)) in x's dtype                                       (`reference_roundtrip`)
With `out` = the store's (q, scale, rope) tensors and `rows`, the codes of row i go to out[.][rows[i]]
(and with `src`, row i is x[src[i]]): a store write is one launch.
With `norm` = (weight, eps, cos, sin) (x bf16 or fp32), the row is first what the model's RMSNorm then
RoPE make of it (`reference_norm_rope`): y = ((x * rsqrt(sum(x^2) / dim + eps)) * weight) in fp32, cast to
x's dtype; pairs (2j, 2j+1) of the trailing rope_dim dims rotated by row i's cos / sin [n, rope_dim / 2]
(e * c - o * s, e * s + o * c in fp32, no fused multiply-add), cast to x's dtype; then encoded as above. The
sum of squares is reduced in the kernel's order, torch's differs: equal where the sums are exact.

The torch form's arithmetic, bit for bit (finite x; +-inf as torch >= 2.12 casts it):
  * amax as the max of |x|'s bit patterns (ordered as the values; above inf's for a NaN);
  * on CUDA, `amax / 448` is a multiply by fp32(1 / 448) (torch divides by a Python scalar so) and
    torch.log2 is libdevice's log2f; on the CPU the division is true and (under the interpreter) numpy's
    log2 stands in for torch's (they agree on ceil(log2) at every power of two times 1 +- 40 ulp, the
    only places they could differ). CUDA_MATH picks the pair; 1e-30 keeps e >= -108, so 2^e is normal;
  * x / 2^e as x * 2^-e (2^-e a power of two: the same real number, so the same rounding; for e = 127,
    x * 2^-126 * 0.5, exact wherever the result is normal, and anything smaller has code 0 either way);
  * e4m3 (torch's software conversion, also on CUDA): a = |r| rounded to e4m3's grid, ties to even, by
    adding and removing 1.5 * 2^23 * step (step 2^(E - 3) for a in [2^E, 2^(E+1)), 2^-9 below 2^-6);
    the sign bit is kept even where the code is zero (-tiny -> 0x80); a > 464 (it would round past 448:
    only inf reaches it) saturates to 448 (0x7E | sign, torch >= 2.12; older torch gave NaN there), NaN
    gives 0x7F — done here in integers because Triton 3.6's interpreter rounds fp8 casts without
    carrying into the exponent and saturates nothing;
  * rope dims -> bf16 round to nearest even on the fp32 bits; bf16 is loaded and stored as its bit
    patterns (int16 views: Triton 3.6's interpreter truncates bf16 casts and flushes their subnormals);
  * decode: code value * 2^e in fp32 (exact: >= 2^-117, at most inf), then to the dtype; rope via bf16.
NaN groups: byte 0, codes 0x7F (positive NaN), NaN out — torch's result on CUDA (NaN -> int64 is 0; a
division by NaN gives the canonical positive NaN there).

Grid: one program per ROWS rows; each input row is read once and each output written once.
"""
from __future__ import annotations

import functools
import math

import torch

from deepinfer.formats.quant import FP8_MAX

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHORT_ROWS = 64  # up to this many rows (decode), one row a program
AMAX_FLOOR = 1e-30


def group_size(nope: int) -> int:
    """Nope dims per scale: 64 (DeepSeek's), or gcd(64, nope) for narrow test models."""
    return math.gcd(64, nope)


def reference(x: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch encode: (q e4m3 [..., nope], E8M0 bytes uint8 [..., nope / g], rope bf16 [..., rope_dim])."""
    nope = x.shape[-1] - rope_dim
    g = x[..., :nope].float().unflatten(-1, (-1, group_size(nope)))
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=AMAX_FLOOR) / FP8_MAX)).clamp(-127, 127)
    q = (g / torch.exp2(exp).unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return q, (exp + 127).to(torch.uint8), x[..., nope:].to(torch.bfloat16)


def reference_norm_rope(x: torch.Tensor, norm: tuple) -> torch.Tensor:
    """Plain torch: the row before encoding when `norm` = (weight, eps, cos, sin) is given (module docstring)."""
    weight, eps, cos, sin = norm
    y = x.float()
    y = ((y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)) * weight.float()).to(x.dtype)
    half = cos.shape[-1]
    r = y[..., y.shape[-1] - 2 * half:].float()
    e, o = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((y[..., :y.shape[-1] - 2 * half], rot), dim=-1)


def reference_decode(q: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain torch decode of stored codes -> [..., nope + rope_dim] in dtype."""
    s = torch.exp2(scale.float() - 127).unsqueeze(-1)
    nope = (q.float().unflatten(-1, (scale.shape[-1], -1)) * s).flatten(-2)
    return torch.cat((nope.to(dtype), rope.to(dtype)), dim=-1)


def reference_roundtrip(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Plain torch: what a write followed by a read returns, in x's dtype."""
    return reference_decode(*reference(x, rope_dim), x.dtype)


def supported(x: torch.Tensor, rope_dim: int) -> bool:
    """The kernel's inputs: float rows [..., dim] with 0 <= rope_dim < dim."""
    return x.dtype in DTYPES and x.dim() >= 1 and 0 <= rope_dim < x.shape[-1]


@functools.lru_cache(maxsize=None)
def _inv_fmt_max() -> float:
    """fp32(1 / 448) as torch on CUDA computes it for `amax / 448` (1.0f / 448.0f)."""
    return float(torch.tensor(1.0) / torch.tensor(FP8_MAX))


if triton is not None:
    @triton.jit
    def _bf16_bits(v):
        """fp32 values exact in bf16 -> their bf16 bit patterns (int16)."""
        return (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16)

    @triton.jit
    def _load_f32(ptrs, mask):
        """Loads as fp32; bf16 comes as its bits (int16 view): the interpreter's bf16 cast flushes subnormals."""
        if ptrs.dtype.element_ty == tl.int16:
            v = tl.load(ptrs, mask=mask, other=0)
            return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _round_bf16(v):
        """fp32 -> the nearest bf16 value (ties to even) as fp32, on the bits (the interpreter truncates casts)."""
        b = v.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_ids(idx_ptr, i, live, HAS: tl.constexpr):
        """Row i as int64, or idx[i] where an index is given."""
        r = i.to(tl.int64)
        if HAS:
            r = tl.load(idx_ptr + i, mask=live, other=0).to(tl.int64)
        return r

    @triton.jit
    def _e4m3_round(a):
        """a >= 0 (at most 464) rounded to e4m3's grid, ties to even, as fp32: to a multiple of its binade's step
        (2^-9 below 2^-6) by adding and removing 1.5 * 2^23 * step."""
        E = tl.minimum(tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6), 8)
        magic = (((147 + E) << 23) | 0x400000).to(tl.float32, bitcast=True)
        return (a + magic) - magic

    @triton.jit
    def _e4m3_magnitude(v):
        """The 7-bit e4m3 code of a magnitude v already on e4m3's grid (_e4m3_round)."""
        return tl.where(v < 0.015625, (v * 512.0).to(tl.int32), (v.to(tl.int32, bitcast=True) >> 20) - 960)

    @triton.jit
    def _to_x_dtype(v, BF16: tl.constexpr):
        """fp32 values cast to x's dtype (bf16 or fp32) and back to fp32."""
        if BF16:
            return _round_bf16(v)
        return v

    @triton.jit
    def _entry_quant_kernel(x_ptr, src_ptr, dst_ptr, q_ptr, s_ptr, r_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, n_rows,
                            stride_x, stride_q, stride_s, stride_r, stride_c, eps,
                            NOPE: tl.constexpr, ROPE: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
                            NG_P: tl.constexpr, ROPE_P: tl.constexpr, ROWS: tl.constexpr,
                            HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, STORE: tl.constexpr,
                            DECODE: tl.constexpr, INV_FMT_MAX: tl.constexpr, CUDA_MATH: tl.constexpr,
                            NORM_ROPE: tl.constexpr = False, HALF_P: tl.constexpr = 1):
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = i < n_rows
        xr, dr = _row_ids(src_ptr, i, live, HAS_SRC), _row_ids(dst_ptr, i, live, HAS_DST)
        grp = tl.arange(0, NG_P)
        cols = grp[:, None] * G + tl.arange(0, G)[None, :]                          # [NG_P, G]
        gm = live[:, None] & (grp < NG)[None, :]                                     # [ROWS, NG_P]
        m = gm[:, :, None]
        x = _load_f32(x_ptr + xr[:, None, None] * stride_x + cols[None, :, :], m)
        if NORM_ROPE:  # RMSNorm over the whole row, then RoPE on the rope pairs, each cast to x's dtype
            BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.int16
            HALF: tl.constexpr = ROPE // 2
            hc = tl.arange(0, HALF_P)
            hm = live[:, None] & (hc < HALF)[None, :]
            pair = x_ptr + xr[:, None] * stride_x + NOPE + 2 * hc[None, :]
            ye, yo = _load_f32(pair, hm), _load_f32(pair + 1, hm)
            ss = tl.sum(tl.sum(x * x, axis=2), axis=1) + tl.sum(ye * ye, axis=1) + tl.sum(yo * yo, axis=1)
            rn = tl.rsqrt(ss / (NOPE + ROPE) + eps)                                 # [ROWS]
            wn = tl.load(w_ptr + cols, mask=(grp < NG)[:, None], other=0.0)
            x = _to_x_dtype((x * rn[:, None, None]) * wn[None, :, :], BF16)
            we = tl.load(w_ptr + NOPE + 2 * hc, mask=hc < HALF, other=0.0)[None, :]
            wo = tl.load(w_ptr + NOPE + 2 * hc + 1, mask=hc < HALF, other=0.0)[None, :]
            ev = _to_x_dtype((ye * rn[:, None]) * we, BF16)
            od = _to_x_dtype((yo * rn[:, None]) * wo, BF16)
            cs = tl.load(cos_ptr + i.to(tl.int64)[:, None] * stride_c + hc[None, :], mask=hm, other=0.0)
            sn = tl.load(sin_ptr + i.to(tl.int64)[:, None] * stride_c + hc[None, :], mask=hm, other=0.0)
            # as stored (bf16): exact after the cast to x's dtype when that is bf16
            ye = _round_bf16(_to_x_dtype(ev * cs - od * sn, BF16))
            yo = _round_bf16(_to_x_dtype(ev * sn + od * cs, BF16))
        bits = x.to(tl.int32, bitcast=True)
        top = tl.max(bits & 0x7FFFFFFF, axis=2)                                      # [ROWS, NG_P]
        nan = top > 0x7F800000
        amax = tl.maximum(top.to(tl.float32, bitcast=True), 1e-30)
        if CUDA_MATH:  # torch on CUDA: multiply by the fp32 reciprocal, libdevice's log2f
            lg = libdevice.log2(amax * INV_FMT_MAX)
        else:  # torch on the CPU: true division (numpy's log2 under the interpreter)
            lg = tl.log2(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        e = tl.minimum(tl.maximum(tl.ceil(lg), -127.0), 127.0).to(tl.int32)
        e = tl.where(nan, 0, e)                                                      # in [-108, 127]
        inv = ((127 - tl.minimum(e, 126)) << 23).to(tl.float32, bitcast=True)       # 2^-min(e, 126)
        r = (x * inv[:, :, None]) * tl.where(e == 127, 0.5, 1.0)[:, :, None]
        # e4m3 magnitude: round a to a multiple of its binade's step (2^-9 below 2^-6), ties to even
        a = tl.abs(r)
        bad = (a != a) | nan[:, :, None]                                             # NaN code
        big = a > 464.0                                                              # rounds past 448; inf
        v = _e4m3_round(tl.where(a <= 464.0, a, 0.0))
        mag = tl.where(bad, 0x7F, tl.where(big, 0x7E, _e4m3_magnitude(v)))
        neg = (bits < 0) & ~nan[:, :, None]
        if STORE:
            code = (mag | (neg.to(tl.int32) << 7)).to(tl.uint8)
            tl.store(q_ptr + dr[:, None, None] * stride_q + cols[None, :, :], code, mask=m)
            tl.store(s_ptr + dr[:, None] * stride_s + grp[None, :], tl.where(nan, 0, e + 127).to(tl.uint8), mask=gm)
        # rope dims: fp32 -> bf16, to nearest even on the bits (exact in bf16 afterwards)
        rc = tl.arange(0, ROPE_P)
        rm = live[:, None] & (rc < ROPE)[None, :]
        if not NORM_ROPE:
            y = _round_bf16(_load_f32(x_ptr + xr[:, None] * stride_x + NOPE + rc[None, :], rm))
        if STORE:  # bf16 as its bits (int16 view): the interpreter's bf16 cast flushes subnormals
            if NORM_ROPE:
                tl.store(r_ptr + dr[:, None] * stride_r + 2 * hc[None, :], _bf16_bits(ye), mask=hm)
                tl.store(r_ptr + dr[:, None] * stride_r + 2 * hc[None, :] + 1, _bf16_bits(yo), mask=hm)
            else:
                tl.store(r_ptr + dr[:, None] * stride_r + rc[None, :], _bf16_bits(y), mask=rm)
        if DECODE:
            val = tl.where(big, 448.0, v).to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)
            val = tl.where(bad, float("nan"), val.to(tl.float32, bitcast=True))
            val = val * ((tl.maximum(e + 127, 1)) << 23).to(tl.float32, bitcast=True)[:, :, None]
            o = out_ptr + i.to(tl.int64)[:, None] * (NOPE + ROPE)
            if out_ptr.dtype.element_ty == tl.int16:  # bf16 out (values exact in bf16: their bits)
                tl.store(o[:, :, None] + cols[None, :, :], _bf16_bits(val), mask=m)
                if NORM_ROPE:
                    tl.store(o + NOPE + 2 * hc[None, :], _bf16_bits(ye), mask=hm)
                    tl.store(o + NOPE + 2 * hc[None, :] + 1, _bf16_bits(yo), mask=hm)
                else:
                    tl.store(o + NOPE + rc[None, :], _bf16_bits(y), mask=rm)
            else:
                ty = out_ptr.dtype.element_ty
                tl.store(o[:, :, None] + cols[None, :, :], val.to(ty), mask=m)
                if NORM_ROPE:
                    tl.store(o + NOPE + 2 * hc[None, :], ye.to(ty), mask=hm)
                    tl.store(o + NOPE + 2 * hc[None, :] + 1, yo.to(ty), mask=hm)
                else:
                    tl.store(o + NOPE + rc[None, :], y.to(ty), mask=rm)


def _check(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [..., dim] as [rows, dim] with unit column stride (a view where one exists)."""
    if not supported(x, rope_dim):
        raise ValueError(f"entry_quant: x must be bf16/fp16/fp32 [..., dim] with 0 <= rope_dim < dim, got "
                         f"{x.dtype} {tuple(x.shape)}, rope_dim {rope_dim}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_out(out, nope: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The store's (q e4m3 [N, nope], scale uint8 [N, nope / g], rope bf16 [N, rope_dim]), unit column stride."""
    q, s, r = out
    want = ((torch.float8_e4m3fn, nope), (torch.uint8, nope // group_size(nope)), (torch.bfloat16, rope_dim))
    for name, t, (dtype, width) in zip(("q", "scale", "rope"), out, want):
        if t.dtype != dtype or t.dim() != 2 or t.shape[1] != width or t.shape[0] != q.shape[0] or \
                (t.stride(1) != 1 and width > 1):
            raise ValueError(f"entry_quant: out {name} must be {dtype} [N, {width}] with unit column stride, "
                             f"got {t.dtype} {tuple(t.shape)} stride {t.stride()}")
    return q.view(torch.uint8), s, r.view(torch.int16)


def _index(t: torch.Tensor | None, n: int, name: str, op: str = "entry_quant") -> torch.Tensor | None:
    """An index tensor flat and contiguous (None stays None); ValueError naming `op` and `name` if it is not
    int32 / int64 with n entries."""
    if t is None:
        return None
    if t.dtype not in (torch.int32, torch.int64) or t.numel() != n:
        raise ValueError(f"{op}: {name} must be int32/int64 with {n} entries, got {t.dtype} {tuple(t.shape)}")
    return t.reshape(-1).contiguous()


def _check_norm(norm: tuple, x: torch.Tensor, n: int, rope_dim: int) -> tuple:
    """(weight fp32 [dim], eps, cos, sin fp32 [n, rope_dim / 2] with unit column stride and equal row strides)."""
    weight, eps, cos, sin = norm
    half = rope_dim // 2
    if x.dtype not in (torch.bfloat16, torch.float32) or rope_dim % 2 or rope_dim == 0:
        raise ValueError(f"entry_quant: norm takes bf16 / fp32 rows with an even rope_dim > 0, got {x.dtype}, "
                         f"rope_dim {rope_dim}")
    if weight.dtype != torch.float32 or weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(f"entry_quant: norm weight must be fp32 [{x.shape[-1]}] on {x.device}, got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    cs = []
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape[-1] != half or t.numel() not in (half, n * half) or \
                t.device != x.device:
            raise ValueError(f"entry_quant: norm {name} must be fp32 [{n}, {half}] (or one row) on {x.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        cs.append(t.reshape(-1, half).expand(n, half))
    if cs[0].stride() != cs[1].stride() or cs[0].stride(-1) != 1:
        cs = [t.contiguous() for t in cs]
    return weight, float(eps), cs[0], cs[1]


def _launch(x: torch.Tensor, rope_dim: int, out=None, rows: torch.Tensor | None = None,
            src: torch.Tensor | None = None, decode: bool = False, ROWS: int | None = None, num_warps: int = 4,
            cuda_math: bool | None = None, norm: tuple | None = None):
    """The Triton launch on whatever device x is on (CPU only under TRITON_INTERPRET=1). Encodes row i
    (x's row src[i] when given) into out[.][rows[i]] (rows: i when not given; out: fresh tensors when not
    given); `decode` also returns the round trip [n, dim] in x's dtype. Returns out, or the round trip.
    `norm` (no src): RMSNorm + RoPE first (module docstring). Indices are not checked against the tensors'
    rows (no host sync)."""
    xr = _check(x, rope_dim)
    dim = x.shape[-1]
    nope = dim - rope_dim
    G = group_size(nope)
    n = xr.shape[0] if src is None else src.numel()
    if norm is not None:
        if src is not None:
            raise ValueError("entry_quant: norm does not take src")
        weight, eps, cos, sin = _check_norm(norm, x, n, rope_dim)
    src, rows = _index(src, n, "src"), _index(rows, n, "rows")
    if out is None and not decode:
        lead = x.shape[:-1] if src is None else (n,)
        out = (torch.empty(*lead, nope, dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty(*lead, nope // G, dtype=torch.uint8, device=x.device),
               torch.empty(*lead, rope_dim, dtype=torch.bfloat16, device=x.device))
        flat = tuple(t.view(n, t.shape[-1]) for t in out)
    else:
        flat = out
    if flat is not None:
        if rows is None and flat[0].shape[0] != n:
            raise ValueError(f"entry_quant: out has {flat[0].shape[0]} rows for {n} rows of x (no `rows` given)")
        q, s, r = _check_out(flat, nope, rope_dim)
    rt = torch.empty(n, dim, dtype=x.dtype, device=x.device) if decode else None
    # one row a program with the norm (its sum's order then never depends on the row count) or at few rows
    # (decode: the shorter per-thread chain is the launch's latency); up to 4096 elements a program otherwise
    if not ROWS:
        ROWS = 1 if norm is not None or n <= SHORT_ROWS else max(1, 4096 // (triton.next_power_of_2(nope // G) * G))
    if n:
        dummy = xr
        _entry_quant_kernel[(triton.cdiv(n, ROWS),)](
            xr.view(torch.int16) if xr.dtype == torch.bfloat16 else xr, dummy if src is None else src, dummy if rows is None else rows,
            dummy if flat is None else q, dummy if flat is None else s, dummy if flat is None else r,
            dummy if rt is None else rt.view(torch.int16) if rt.dtype == torch.bfloat16 else rt,
            *((weight, cos, sin) if norm is not None else (dummy, dummy, dummy)), n, xr.stride(0),
            *((q.stride(0), s.stride(0), r.stride(0)) if flat is not None else (0, 0, 0)),
            cos.stride(0) if norm is not None else 0, eps if norm is not None else 0.0,
            NOPE=nope, ROPE=rope_dim, G=G, NG=nope // G, NG_P=triton.next_power_of_2(nope // G),
            ROPE_P=triton.next_power_of_2(max(rope_dim, 1)), ROWS=ROWS, HAS_SRC=src is not None,
            HAS_DST=rows is not None, STORE=flat is not None, DECODE=decode, INV_FMT_MAX=_inv_fmt_max(),
            CUDA_MATH=x.is_cuda if cuda_math is None else cuda_math, NORM_ROPE=norm is not None,
            HALF_P=triton.next_power_of_2(max(rope_dim // 2, 1)), num_warps=num_warps, enable_fp_fusion=False)
    if decode:
        return rt.view(*(x.shape[:-1] if src is None else (n,)), dim)
    return out


def _kernel_takes(x: torch.Tensor, rope_dim: int, out=None, *index: torch.Tensor | None) -> bool:
    """CUDA rows of a supported shape; the store's tensors and indices (int32 / int64) on x's device."""
    if triton is None or not x.is_cuda or not supported(x, rope_dim):
        return False
    idx = [t for t in index if t is not None]
    return all(t.device == x.device for t in list(out or ()) + idx) and \
        all(t.dtype in (torch.int32, torch.int64) for t in idx)


def entry_encode(x: torch.Tensor, rope_dim: int, out=None, rows: torch.Tensor | None = None,
                 src: torch.Tensor | None = None, norm: tuple | None = None):
    """Encode x (its rows src when given; with `norm`, RMSNorm + RoPE first: module docstring). Without
    `out`: returns (q, scale, rope) as `reference`. With the store's tensors `out`: writes them at `rows`
    (or rows 0..n-1). Triton on CUDA (one launch), torch elsewhere."""
    if _kernel_takes(x, rope_dim, out, rows, src):
        return _launch(x, rope_dim, out, rows, src, norm=norm)
    if norm is not None:
        if src is not None:
            raise ValueError("entry_quant: norm does not take src")
        x = reference_norm_rope(x, norm)
    codes = reference(x if src is None else x[src], rope_dim)
    if out is None:
        return codes
    at = slice(None) if rows is None else rows
    for t, c in zip(out, codes):
        t[at] = c
    return out


def entry_roundtrip(x: torch.Tensor, rope_dim: int, out=None, rows: torch.Tensor | None = None,
                    norm: tuple | None = None) -> torch.Tensor:
    """decode(encode(x)) in x's dtype (`reference_roundtrip`; with `norm`, of x after RMSNorm + RoPE); with the
    store's tensors `out` and `rows`, the codes are also written there (as entry_encode). Triton on CUDA (one
    launch), torch elsewhere."""
    if _kernel_takes(x, rope_dim, out, rows):
        return _launch(x, rope_dim, out, rows, decode=True, norm=norm)
    if norm is not None:
        x = reference_norm_rope(x, norm)
    if out is not None:
        entry_encode(x, rope_dim, out, rows)
    return reference_roundtrip(x, rope_dim)
