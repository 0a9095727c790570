"""DeepSeek-V4.1's FP8 cache format (formats/group_quant.py "fp8", the window rings' and compressed entries'
`auto` format) in one launch each: encode (optionally gathered from x's rows `src` and scattered into the store's
rows `rows`), the write-then-read round trip, and the decode of stored rows.

For x [..., dim] (bf16 / fp32, dim a multiple of 32), per group of 32 channels (`group_quant.encode`):
    scale = pow2_ceil(max(amax, fp32(1e-4)) * fp32(1 / 448))    the smallest power of two >= the product
    codes = e4m3(clamp(x / scale, -448, 448))                     round to nearest, ties to even
    byte  = scale's biased exponent (E8M0)
    decode: codes * 2^(byte - 127) in fp32, then the dtype; roundtrip: decode(encode(x)) in x's dtype.
The torch form's arithmetic, bit for bit, for finite x:
  * amax is the max of |x|'s bit patterns (ordered as the values); the product rounds to fp32 (torch multiplies
    an fp32 tensor by the Python scalar 1 / 448 as fp32, on the CPU and on CUDA);
  * pow2_ceil on the product's bits: its exponent, plus one if any mantissa bit is set (the product is normal:
    at least 1e-4 / 448);
  * x / scale as x * 2^-k (scale = 2^k, k in [-22, 120]: the same real number, so the same rounding, also where
    the result is subnormal; Triton's `/` on CUDA is not correctly rounded, a multiply by a power of two is);
  * e4m3 (torch's conversion): |r| rounded to e4m3's grid, ties to even, by adding and removing 1.5 * 2^23 * step
    (step 2^(E - 3) for |r| in [2^E, 2^(E+1)), 2^-9 below 2^-6), done in integers (Triton 3.6's interpreter
    rounds fp8 casts without carrying into the exponent); the sign bit is kept where the code is zero (-0.0 and
    -tiny -> 0x80); after the clamp no value rounds past 448;
  * decode: the code's value times 2^(byte - 127) is exact in fp32 and in bf16 (4 significant bits, exponent
    >= -31), so bf16 output is the fp32 value's top half; bf16 is loaded and stored as its bits (int16 views:
    the interpreter's bf16 casts truncate and flush subnormals).
Grid: one program per ROWS rows; each input row is read once and each output written once.
"""
from __future__ import annotations

import torch

from deepinfer.formats import group_quant
from deepinfer.kernels.entry_quant import _index

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

G = group_quant.GROUP["fp8"]
DTYPES = (torch.bfloat16, torch.float32)
SHORT_ROWS = 64  # up to this many rows (decode steps), one row a program
INV_FMT_MAX = float(torch.tensor(1 / 448, dtype=torch.float32))  # the fp32 scalar torch multiplies amax by


def reference_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch encode: (codes e4m3 [..., dim], E8M0 bytes uint8 [..., dim / 32])."""
    return group_quant.encode(x, "fp8")


def reference_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return group_quant.decode(codes, scale, "fp8", dtype)


def reference_roundtrip(x: torch.Tensor) -> torch.Tensor:
    return group_quant.roundtrip(x, "fp8")


def supported(x: torch.Tensor) -> bool:
    """The kernels' rows: bf16 / fp32 [..., dim] with dim a positive multiple of 32."""
    return x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] > 0 and x.shape[-1] % G == 0


if triton is not None:
    from deepinfer.kernels.entry_quant import _bf16_bits, _e4m3_magnitude, _e4m3_round, _load_f32, _row_ids

    @triton.jit
    def _store_f32(ptrs, v, mask):
        """Stores fp32 values exact in the output's dtype (bf16: as its bits, the fp32 value's top half)."""
        if ptrs.dtype.element_ty == tl.int16:
            tl.store(ptrs, _bf16_bits(v), mask=mask)
        else:
            tl.store(ptrs, v, mask=mask)

    @triton.jit
    def _encode_kernel(x_ptr, src_ptr, dst_ptr, q_ptr, s_ptr, out_ptr, n_rows, stride_x, stride_q, stride_s,
                       GS: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, ROWS: tl.constexpr,
                       HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, STORE: tl.constexpr, DECODE: tl.constexpr,
                       INV_FMT_MAX: tl.constexpr):
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = i < n_rows
        xr, dr = _row_ids(src_ptr, i, live, HAS_SRC), _row_ids(dst_ptr, i, live, HAS_DST)
        grp = tl.arange(0, NG_P)
        cols = grp[:, None] * GS + tl.arange(0, GS)[None, :]                        # [NG_P, GS]
        gm = live[:, None] & (grp < NG)[None, :]                                     # [ROWS, NG_P]
        m = gm[:, :, None]
        x = _load_f32(x_ptr + xr[:, None, None] * stride_x + cols[None, :, :], m)
        bits = x.to(tl.int32, bitcast=True)
        amax = tl.max(bits & 0x7FFFFFFF, axis=2).to(tl.float32, bitcast=True)       # [ROWS, NG_P]
        p = (tl.maximum(amax, 1e-4) * INV_FMT_MAX).to(tl.int32, bitcast=True)
        byte = ((p >> 23) & 0xFF) + ((p & 0x7FFFFF) != 0).to(tl.int32)             # pow2_ceil's biased exponent
        inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)                      # 1 / scale, exactly
        r = tl.minimum(tl.maximum(x * inv[:, :, None], -448.0), 448.0)
        v = _e4m3_round(tl.abs(r))                                                   # the code's magnitude
        neg = bits < 0
        if STORE:
            code = (_e4m3_magnitude(v) | (neg.to(tl.int32) << 7)).to(tl.uint8)
            tl.store(q_ptr + dr[:, None, None] * stride_q + cols[None, :, :], code, mask=m)
            tl.store(s_ptr + dr[:, None] * stride_s + grp[None, :], byte.to(tl.uint8), mask=gm)
        if DECODE:
            val = (v.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)).to(tl.float32, bitcast=True)
            val = val * (byte << 23).to(tl.float32, bitcast=True)[:, :, None]
            _store_f32(out_ptr + i.to(tl.int64)[:, None, None] * (NG * GS) + cols[None, :, :], val, m)

    @triton.jit
    def _decode_kernel(q_ptr, s_ptr, rows_ptr, out_ptr, n_rows, stride_q, stride_s,
                       GS: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, ROWS: tl.constexpr):
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = i < n_rows
        sr = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64)
        grp = tl.arange(0, NG_P)
        cols = grp[:, None] * GS + tl.arange(0, GS)[None, :]
        gm = live[:, None] & (grp < NG)[None, :]
        m = gm[:, :, None]
        c = tl.load(q_ptr + sr[:, None, None] * stride_q + cols[None, :, :], mask=m, other=0).to(tl.int32)
        byte = tl.load(s_ptr + sr[:, None] * stride_s + grp[None, :], mask=gm, other=127).to(tl.int32)
        e, mant = (c >> 3) & 15, c & 7
        normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)            # subnormals: m * 2^-9
        mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
        val = (mag.to(tl.int32, bitcast=True) | ((c >> 7) << 31)).to(tl.float32, bitcast=True)
        val = val * (tl.maximum(byte, 1) << 23).to(tl.float32, bitcast=True)[:, :, None]
        _store_f32(out_ptr + i.to(tl.int64)[:, None, None] * (NG * GS) + cols[None, :, :], val, m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] as [rows, dim] with unit column stride (a view where one exists)."""
    if not supported(x):
        raise ValueError(f"group_fp8: x must be bf16/fp32 [..., dim] with dim a multiple of {G}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _grid_rows(n: int, ng: int, ROWS: int | None) -> int:
    """Rows a program: one at decode sizes (the shortest chain per thread), up to 4096 elements otherwise."""
    return ROWS or (1 if n <= SHORT_ROWS else max(1, 4096 // (triton.next_power_of_2(ng) * G)))


def _launch_encode(x: torch.Tensor, out=None, rows: torch.Tensor | None = None, src: torch.Tensor | None = None,
                   decode: bool = False, ROWS: int | None = None, num_warps: int = 4):
    """The Triton launch on x's device (the CPU only under TRITON_INTERPRET=1): row i (x's row src[i] when given)
    encoded into out = (codes, scale) at rows[i] (i without rows; fresh tensors without out); with `decode`, also
    its round trip [n, dim] in x's dtype, returned. Indices are not checked against the tensors (no host sync)."""
    xr = _rows(x)
    dim = x.shape[-1]
    ng = dim // G
    n = xr.shape[0] if src is None else src.numel()
    src, rows = _index(src, n, "src", "group_fp8"), _index(rows, n, "rows", "group_fp8")
    if out is None and not decode:
        lead = x.shape[:-1] if src is None else (n,)
        out = (torch.empty(*lead, dim, dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty(*lead, ng, dtype=torch.uint8, device=x.device))
    flat = None if out is None else tuple(t.view(-1, t.shape[-1]) for t in out)
    if flat is not None:
        q, s = flat
        if q.dtype != torch.float8_e4m3fn or s.dtype != torch.uint8 or q.shape[1] != dim or s.shape[1] != ng or \
                q.stride(1) != 1 or s.stride(1) != 1 or q.shape[0] != s.shape[0]:
            raise ValueError(f"group_fp8: out must be (e4m3 [N, {dim}], uint8 [N, {ng}]) with unit column stride, got "
                             f"{q.dtype} {tuple(q.shape)}, {s.dtype} {tuple(s.shape)}")
        if rows is None and q.shape[0] != n:
            raise ValueError(f"group_fp8: out has {q.shape[0]} rows for {n} rows of x (no `rows` given)")
    rt = torch.empty(n, dim, dtype=x.dtype, device=x.device) if decode else None
    if n:
        R = _grid_rows(n, ng, ROWS)
        d = xr
        _encode_kernel[(triton.cdiv(n, R),)](
            _bits(xr), d if src is None else src, d if rows is None else rows,
            d if flat is None else flat[0].view(torch.uint8), d if flat is None else flat[1],
            d if rt is None else _bits(rt), n, xr.stride(0), 0 if flat is None else flat[0].stride(0),
            0 if flat is None else flat[1].stride(0), GS=G, NG=ng, NG_P=triton.next_power_of_2(ng), ROWS=R,
            HAS_SRC=src is not None, HAS_DST=rows is not None, STORE=flat is not None, DECODE=decode,
            INV_FMT_MAX=INV_FMT_MAX, num_warps=num_warps,
            enable_fp_fusion=False)
    if decode:
        return rt.view(*(x.shape[:-1] if src is None else (n,)), dim)
    return out


def _launch_decode(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype,
                   ROWS: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """The stored rows codes[rows], scale[rows] decoded -> [n, dim] in dtype (bf16 / fp32), one launch."""
    dim, ng = codes.shape[-1], scale.shape[-1]
    n = rows.numel()
    rows = _index(rows, n, "rows", "group_fp8")
    out = torch.empty(n, dim, dtype=dtype, device=codes.device)
    if n:
        R = _grid_rows(n, ng, ROWS)
        _decode_kernel[(triton.cdiv(n, R),)](
            codes.view(torch.uint8), scale, rows, _bits(out), n, codes.stride(0), scale.stride(0), GS=G, NG=ng,
            NG_P=triton.next_power_of_2(ng), ROWS=R, num_warps=num_warps, enable_fp_fusion=False)
    return out


def _indices(*index) -> bool:
    """Each index None or an int32 / int64 tensor (anything else, e.g. a slice, takes the torch form)."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64)) for t in index)


def _kernel_takes(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """CUDA rows of a supported shape, every other tensor on x's device."""
    return triton is not None and x.is_cuda and supported(x) and \
        all(t.device == x.device for t in others if t is not None)


def encode_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                src: torch.Tensor | None = None) -> None:
    """codes[rows], scale[rows] = encode(x[src] or x): one launch on CUDA, torch elsewhere."""
    if _indices(rows, src) and _kernel_takes(x, codes, scale, rows, src):
        _launch_encode(x, (codes, scale), rows, src)
        return
    codes[rows], scale[rows] = reference_encode(x if src is None else x[src])


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) in x's dtype: one launch on CUDA, torch elsewhere."""
    if _kernel_takes(x):
        return _launch_encode(x, decode=True)
    return reference_roundtrip(x)


def decode_rows(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """decode(codes[rows], scale[rows]) [n, dim] in dtype: one launch on CUDA (bf16 / fp32), torch elsewhere."""
    if triton is not None and codes.is_cuda and dtype in DTYPES and _indices(rows) and rows.device == codes.device:
        return _launch_decode(codes, scale, rows, dtype).view(*rows.shape, codes.shape[-1])
    return reference_decode(codes[rows], scale[rows], dtype)
