"""The lightning indexer's FP4 rotation in one kernel: Walsh-Hadamard rotation, then FP4 (E2M1 codes, a
power-of-two E8M0 scale per group of 32). Queries take the round trip, keys are stored as codes:

    q [..., D] (bf16 / fp16 / fp32, D a power of two in [32, 1024])  ->  out [..., D] in q's dtype
    index_query: out = fp4_roundtrip(hadamard(q.float()), 32).to(q.dtype)                 (`reference`)
    index_keys:  (packed int8 [..., D/2], E8M0 uint8 [..., D/32]) = quant_fp4(hadamard(k.float()), 32)
                 (even column in the low nibble, sign in bit 3)                          (`reference_keys`)

The torch form's arithmetic on CUDA, bit for bit, per row of D values in fp32:
  * rotation: log2(D) butterfly stages h = 1, 2, ..., D/2; stage h maps the pair (i, i + h), bit h
    of i clear, to (y[i] + y[i+h], y[i] - y[i+h]): the same fp32 adds in the same order (reshape /
    permute / split / join only move values); then one multiply by fp32(D ** -0.5);
  * scale per group of 32: e = clamp(ceil(log2(max(amax, 1e-30) * fp32(1 / 6))), -127, 127), s = 2^e,
    with libdevice's log2f (torch.log2 on CUDA; torch on CUDA divides by a Python scalar as a multiply
    by its fp32 reciprocal). 1e-30 keeps e >= -102, so s and 1/s are normal except 2^-127 (amax = inf);
  * codes: r = x / s, taken as x * 2^-e (exact wherever |r| >= 2^-126; anything smaller has code 0);
    |r| clamped to 6 and rounded to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, to nearest, ties to the
    even code (.75 -> 1, 1.75 -> 2, 3.5 -> 4 up; .25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4 down), as
    `_fp4_codes`' nudged bucket bounds do; the sign only on non-zero codes (|r| <= .25 gives +0.0);
  * out = code value * s (exact), cast to q's dtype; keys: the codes and the byte e + 127.
NaN: a group holding one (after the rotation a NaN fills its row) gives +6.0 everywhere (codes 7, byte
127), the torch form's result on CUDA: there a NaN scale's E8M0 byte is 127 (NaN -> int32 is 0) and
bucketize puts NaN codes last (+6; GPU NaNs are positive). The torch form on the CPU differs in two
ways the kernel does not follow: a NaN scale's byte is 0 (x86 NaN -> int32 is INT_MIN), and amax / 6
is a true division, so where fp32 log2 rounds onto an integer (amax / 6 just above a power of two,
|e| >= 3) its e can differ.
Under the interpreter (CPU tensors) numpy's log2 stands in for libdevice's.

Grid: one program per ROWS rows; the input is read once and each output written once.
"""
from __future__ import annotations

import functools

import torch

from deepinfer.formats.quant import fp4_roundtrip, hadamard, quant_fp4

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

GROUP = 32
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def reference(q: torch.Tensor) -> torch.Tensor:
    """Plain torch: IndexKeyStore's FP4 query preparation."""
    return fp4_roundtrip(hadamard(q.float()), GROUP).to(q.dtype)


def reference_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: IndexKeyStore's FP4 key encoding, (int8 packed [..., D/2], uint8 E8M0 [..., D/32])."""
    packed, scale = quant_fp4(hadamard(k.float()), GROUP)
    return packed, scale.view(torch.uint8)


def supported(q: torch.Tensor) -> bool:
    """The kernel's shapes and dtypes: width a power of two from 32 to 1024, float rows."""
    D = q.shape[-1] if q.dim() else 0
    return q.dtype in DTYPES and GROUP <= D <= 1024 and D & (D - 1) == 0


@functools.lru_cache(maxsize=None)
def _fp32(v: float) -> float:
    """v rounded to fp32, as torch rounds a Python scalar operand of an fp32 op."""
    return float(torch.tensor(v, dtype=torch.float32))


if triton is not None:
    @triton.jit
    def _butterfly(x, ROWS: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
        """One stage: pairs (i, i + H) with bit H of i clear -> (x[i] + x[i+H], x[i] - x[i+H])."""
        y = tl.permute(tl.reshape(x, (ROWS, D // (2 * H), 2, H)), (0, 1, 3, 2))   # [.., H, pair]
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))                       # [.., pair, H]
        return tl.reshape(y, (ROWS, D))

    @triton.jit
    def _rotated_fp4(q_ptr, n_rows, stride_q, D: tl.constexpr, LOG_D: tl.constexpr, ROWS: tl.constexpr,
                     NORM: tl.constexpr, INV_FMT_MAX: tl.constexpr, CUDA_LOG2: tl.constexpr):
        """ROWS rows of q from program_id(0) * ROWS, rotated and rounded to FP4: (rows, mask [ROWS, 1],
        code magnitudes [ROWS, D/32, 32] in {0, .5, .., 6}, negative [ROWS, D/32, 32] (set on non-zero
        codes only), scale exponents e [ROWS, D/32]). NaN groups: magnitude 6, positive, e = 0."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, D)
        m = (rows < n_rows)[:, None]
        x = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        for s in tl.static_range(LOG_D):
            x = _butterfly(x, ROWS, D, 1 << s)
        x = tl.reshape(x * NORM, (ROWS, D // 32, 32))
        # amax as the max of |x|'s bit patterns: ordered as the values, and above inf's for a NaN
        top = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)           # [ROWS, D / 32]
        nan = top > 0x7F800000
        amax = top.to(tl.float32, bitcast=True)
        v = tl.maximum(amax, 1e-30) * INV_FMT_MAX
        if CUDA_LOG2:  # log2f of CUDA's math library, as torch.log2 on CUDA
            lg = libdevice.log2(v)
        else:  # the interpreter has no libdevice: numpy's log2
            lg = tl.log2(v)
        e = tl.minimum(tl.maximum(tl.ceil(lg), -127.0), 127.0).to(tl.int32)
        e = tl.where(nan, 0, e)                                                  # in [-102, 127]
        # r = x / 2^e as (x * 2^-min(e, 126)) * (1 or 1/2): exact wherever |r| >= 2^-126, and a value that
        # comes out subnormal has code 0 either way
        inv = ((127 - tl.minimum(e, 126)) << 23).to(tl.float32, bitcast=True)[:, :, None]
        r = (x * inv) * tl.where(e == 127, 0.5, 1.0)[:, :, None]
        # E2M1 round to nearest even of a = min(|r|, 6): steps of .5 below 2, 1 below 4, 2 above
        # (adding 1.5 * 2^(23 + log2 step) rounds to the step, ties to the even multiple; the even
        # multiples are the even codes)
        a = tl.minimum(tl.abs(r), 6.0)
        magic = tl.where(a < 2.0, 6291456.0, tl.where(a < 4.0, 12582912.0, 25165824.0))
        mag = tl.where(nan[:, :, None], 6.0, (a + magic) - magic)
        neg = r < -0.25                                                          # |r| <= .25, NaN: code +0 / +6
        return rows, m, mag, neg, e

    @triton.jit
    def _index_query_kernel(q_ptr, out_ptr, n_rows, stride_q,
                            D: tl.constexpr, LOG_D: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr,
                            INV_FMT_MAX: tl.constexpr, CUDA_LOG2: tl.constexpr):
        rows, m, mag, neg, e = _rotated_fp4(q_ptr, n_rows, stride_q, D, LOG_D, ROWS, NORM, INV_FMT_MAX, CUDA_LOG2)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)[:, :, None]       # 2^e
        out = tl.reshape(tl.where(neg, -mag, mag) * scale, (ROWS, D))
        cols = tl.arange(0, D)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _index_keys_kernel(k_ptr, packed_ptr, scale_ptr, n_rows, stride_k,
                           D: tl.constexpr, LOG_D: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr,
                           INV_FMT_MAX: tl.constexpr, CUDA_LOG2: tl.constexpr):
        rows, m, mag, neg, e = _rotated_fp4(k_ptr, n_rows, stride_k, D, LOG_D, ROWS, NORM, INV_FMT_MAX, CUDA_LOG2)
        # E2M1 code: magnitude index (0, .5, 1, 1.5, 2 -> 0..4; 3, 4, 6 -> 5, 6, 7) | sign << 3
        idx = tl.where(mag <= 2.0, mag * 2.0, tl.where(mag < 5.0, mag + 2.0, 7.0)).to(tl.int32)
        codes = tl.reshape(idx | (neg.to(tl.int32) << 3), (ROWS, D // 2, 2))
        lo, hi = tl.split(codes)                                                 # even column: low nibble
        half = tl.arange(0, D // 2)
        tl.store(packed_ptr + rows.to(tl.int64)[:, None] * (D // 2) + half[None, :],
                 (lo | (hi << 4)).to(tl.int8), mask=m)
        groups = tl.arange(0, D // 32)
        tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (D // 32) + groups[None, :], (e + 127).to(tl.uint8), mask=m)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] as [rows, D] with unit column stride (a view where one exists)."""
    if not supported(x):
        raise ValueError(f"index_query: {name} must be bf16/fp16/fp32 [..., D] with D a power of two in "
                         f"[32, 1024], got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _consts(x: torch.Tensor, ROWS: int | None, num_warps: int, cuda_log2: bool | None) -> dict:
    """The kernels' constexprs and options for rows x [..., D]: ROWS rows a program (default 4096 values:
    16 a thread at 8 warps); libdevice's log2 unless told (default: x is on CUDA; the interpreter has none)."""
    D = x.shape[-1]
    return dict(D=D, LOG_D=D.bit_length() - 1, ROWS=ROWS or 4096 // D, NORM=_fp32(D ** -0.5),
                INV_FMT_MAX=_fp32(1 / 6), CUDA_LOG2=x.is_cuda if cuda_log2 is None else cuda_log2,
                num_warps=num_warps, enable_fp_fusion=False)


def _launch(q: torch.Tensor, ROWS: int | None = None, num_warps: int = 8,
            cuda_log2: bool | None = None) -> torch.Tensor:
    """`index_query`'s Triton launch on whatever device q is on (CPU only under TRITON_INTERPRET=1)."""
    x, c = _rows(q, "q"), _consts(q, ROWS, num_warps, cuda_log2)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if x.shape[0]:
        _index_query_kernel[(triton.cdiv(x.shape[0], c["ROWS"]),)](x, out, x.shape[0], x.stride(0), **c)
    return out


def _launch_keys(k: torch.Tensor, ROWS: int | None = None, num_warps: int = 8,
                 cuda_log2: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`index_keys`' Triton launch (as `_launch`)."""
    x, c = _rows(k, "k"), _consts(k, ROWS, num_warps, cuda_log2)
    D = k.shape[-1]
    packed = torch.empty(*k.shape[:-1], D // 2, dtype=torch.int8, device=k.device)
    scale = torch.empty(*k.shape[:-1], D // GROUP, dtype=torch.uint8, device=k.device)
    if x.shape[0]:
        _index_keys_kernel[(triton.cdiv(x.shape[0], c["ROWS"]),)](x, packed, scale, x.shape[0], x.stride(0), **c)
    return packed, scale


def index_query(q: torch.Tensor) -> torch.Tensor:
    """fp4_roundtrip(hadamard(q.float()), 32).to(q.dtype): Triton on CUDA, `reference` elsewhere or for
    shapes the kernel does not take. No host sync (CUDA-graph capturable)."""
    if triton is None or not q.is_cuda or not supported(q):
        return reference(q)
    return _launch(q)


def index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' side of the same rounding, as stored: quant_fp4(hadamard(k.float()), 32) with the scale as
    uint8 E8M0 bytes (`reference_keys`); Triton on CUDA, as `index_query`."""
    if triton is None or not k.is_cuda or not supported(k):
        return reference_keys(k)
    return _launch_keys(k)
