"""Linear layers for dense or checkpoint-quantised (FP8 block / FP4 expert) weights.

Quantised mode keeps the checkpoint's tensors as they are (`weight` e4m3 + `scale`
E8M0 or fp32, named exactly as on disk) and dequantises on the fly: this is the
storage the GPU path consumes. Dense mode holds `weight` in the model dtype.
On CUDA with bf16 activations a quantised Linear picks its GEMM by the row count M:
  * M >= FP8_GEMM_ROWS (prefill; compute-bound): W8A8 as DeepSeek's reference computes it, the
    input quantised per 1 x ACT_GROUP group to e4m3 with power-of-two scales (kernels/act_quant.py)
    and an FP8 x FP8 tensor-core GEMM with block scales on both operands (kernels/fp8_gemm.py:
    torch._scaled_mm blockwise for 128 x 128 weight blocks, Triton otherwise);
  * fewer rows (decode; weight-bandwidth-bound): W8A16, the Triton grouped GEMM with one group
    (kernels/grouped_gemm.py: FP8 weight tiles widened in registers, activations stay bf16, so the
    result is closer to exact than the reference's, which quantises activations at every size; one row
    runs its GEMV, 2-63 rows with 128-wide E8M0 K blocks its swapped dot).
Batch-invariant mode runs W8A16 with invariant.GEMM_TILES at every M (one path whatever the batch).
Weights whose blocks are not powers of two >= ACT_GROUP wide along K stay on W8A16 (V4.1's 32 x 32:
measured slower as W8A8, see FP8_GEMM_ROWS). Elsewhere (CPU, fp32
activations) the weight is dequantised and multiplied densely, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.act_quant import act_quant
from deepinfer.kernels.fp8_gemm import ROW_PAD, fp8_gemm, scaled_mm_available, use_scaled_mm
from deepinfer.kernels.grouped_gemm import grouped_gemm, triton_available
from deepinfer.layers import invariant
from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks, scale_to_float


@dataclass(frozen=True)
class QuantSpec:
    """How a module's weights are held: dense (block_size None) or as the checkpoint stores them."""

    block_size: tuple[int, int] | None = None
    scale_dtype: torch.dtype = torch.float8_e8m0fnu
    fp4_experts: bool = False

    @property
    def quantized(self) -> bool:
        return self.block_size is not None


DENSE = QuantSpec()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Linear(nn.Module):
    """y = x W^T; `quant` marks a checkpoint-FP8 weight (ignored in dense mode)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 quant: QuantSpec = DENSE, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size = quant.block_size
        if quant.quantized:
            bo, bi = quant.block_size
            self.register_buffer("weight", torch.empty(out_features, in_features,
                                                       dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("scale", torch.empty(_cdiv(out_features, bo), _cdiv(in_features, bi),
                                                      dtype=quant.scale_dtype, device=device))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                       requires_grad=False)
        # `scale` widened to fp32 (prepare_fp8_linears: once the weights are loaded), the W8A8 GEMM's weight
        # scale operand; None: W8A8 widens `scale` at each call. Not a buffer: never saved or loaded.
        self.scale_fp32: torch.Tensor | None = None

    def w8a8_scale(self) -> torch.Tensor:
        return self.scale if self.scale_fp32 is None else self.scale_fp32

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.block_size is None:
            return self.weight.to(dtype)
        return dequant_fp8_blocks(self.weight, self.scale, self.block_size, dtype)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T computed and returned in fp32 (see matmul_fp32)."""
        if self.block_size is None:
            return matmul_fp32(x, self.weight)
        return dense_linear(x.float(), self.dense_weight(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_size is not None and x.is_cuda and x.dtype == torch.bfloat16 and triton_available():
            a = x.reshape(-1, self.in_features)
            if fp8_gemm_rows(a.shape[0], self.block_size):  # W8A8: compute-bound row counts
                y = fp8_linear(a, self.weight, self.w8a8_scale(), self.block_size)
            else:  # W8A16: one group, the FP8 tiles dequantised in the GEMM's registers
                y = grouped_gemm(a, self.weight, None, self.scale, self.block_size, **invariant.gemm_tiles())
            return y.view(*x.shape[:-1], self.out_features)
        return dense_linear(x, self.dense_weight(x.dtype))

    def forward_grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, I] through the weight as G row blocks [G, O, I] (O = out_features / G), group g's
        inputs meeting block g only -> [T, G * O] (V4's grouped output projection wo_a).
        FP8 on CUDA below GROUPED_GEMM_ROWS tokens: one Triton grouped GEMM over the group-major
        rows, FP8 tiles dequantised in registers (no per-step bf16 copy of the weight); from
        FP8_GEMM_ROWS tokens (when O is whole weight blocks) W8A8: the input quantised once (its
        1 x ACT_GROUP groups never straddle two groups' inputs when I % ACT_GROUP == 0) and one
        FP8 GEMM per group on its column slice; otherwise the dense weight through `grouped_linear`."""
        T, G, I = x.shape
        O = self.out_features // G
        if (self.block_size is not None and x.is_cuda and x.dtype == torch.bfloat16 and triton_available()
                and fp8_gemm_rows(T, self.block_size, GROUPED_FP8_GEMM_ROWS) and O % self.block_size[0] == 0
                and I % ACT_GROUP == 0):
            return fp8_linear_grouped(x, self.weight, self.w8a8_scale(), self.block_size)
        if (self.block_size is not None and x.is_cuda and x.dtype == torch.bfloat16 and triton_available()
                and 0 < T < GROUPED_GEMM_ROWS and O % self.block_size[0] == 0 and not invariant.enabled()):
            a = x.transpose(0, 1).reshape(G * T, I)
            offs = torch.arange(T, G * T + 1, T, dtype=torch.int32, device=x.device)  # group g: rows gT .. (g+1)T-1
            y = grouped_gemm(a, self.weight.view(G, O, I), offs, self.scale.view(G, -1, self.scale.shape[-1]),
                             self.block_size)
            return y.view(G, T, O).transpose(0, 1).reshape(T, G * O)
        return grouped_linear(x, self.dense_weight(x.dtype).view(G, O, I))


GROUPED_GEMM_ROWS = 512  # prefill keeps dequant + cuBLAS per group (the weight copy is small beside its GEMMs)
# W8A8 from this many rows, for weight blocks at least ACT_GROUP wide along K (V4's 128 x 128). Summed over V4's
# eight projection shapes, act_quant + cuBLAS blockwise (fp32 weight scales) overtakes the W8A16 kernel between
# 16 and 32 rows; at 64 rows it is ahead on the five largest shapes (by 2-17 us each) and behind on the three
# smallest (by 2-5 us), from 128 rows ahead on all but N = 64 (benchmarks/NOTES.md, "2026-12-02, second
# session": kernel_sweep.py --only fp8-rows). V4.1's 32 x 32 blocks stay on W8A16 (its Triton W8A8: slower).
FP8_GEMM_ROWS = 64
# forward_grouped's W8A8 runs one GEMM per group (8 for V4's wo_a): it keeps the grouped W8A16 kernel longer
GROUPED_FP8_GEMM_ROWS = 1024
ACT_GROUP = 128  # the reference's act_quant group (1 x 128, power-of-two scales)


def w8a8_blocks(block: tuple[int, int]) -> bool:
    """Whether an FP8 weight of `block` can take W8A8: power-of-two blocks at least ACT_GROUP wide along K."""
    bo, bi = block
    return bo > 0 and bi >= ACT_GROUP and not (bo & (bo - 1)) and not (bi & (bi - 1))


def fp8_gemm_rows(M: int, block: tuple[int, int], rows: int = FP8_GEMM_ROWS) -> bool:
    """Whether M rows through an FP8 weight of `block` take W8A8 (from `rows` rows, outside batch-invariant
    mode)."""
    return M >= rows and w8a8_blocks(block) and not invariant.enabled()


def prepare_fp8_linears(model: nn.Module) -> None:
    """Once a model's weights are in place on a GPU: each FP8 Linear whose blocks can take W8A8 gets
    `scale_fp32` (its scale widened once, instead of at every W8A8 call), and the device is probed for
    torch._scaled_mm's blockwise recipe here, outside any CUDA-graph capture (a capture on an unprobed device
    would record the Triton GEMM). Whoever rewrites a Linear's scale afterwards calls this again."""
    probed = set()
    for m in model.modules():
        if isinstance(m, Linear) and m.block_size is not None and m.scale.is_cuda and w8a8_blocks(m.block_size):
            m.scale_fp32 = scale_to_float(m.scale).contiguous()
            if m.scale.device not in probed:
                probed.add(m.scale.device)
                scaled_mm_available(m.scale.device)


def _quantised_input(a: torch.Tensor, N: int, K: int,
                     block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """act_quant's (q, s) for a [M, *], rows padded to ROW_PAD when cuBLAS will run the GEMMs (each
    N x K), and the fp8_gemm backend that takes them."""
    M = a.shape[0]
    backend = "scaled_mm" if use_scaled_mm(a.device, N, K, ACT_GROUP, block) else "triton"
    rows = -(-M // ROW_PAD) * ROW_PAD if backend == "scaled_mm" else M
    q, s = act_quant(a, ACT_GROUP, rows=rows)
    return q, s, backend


def fp8_linear(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W8A8 a [M, K] bf16 @ w [N, K]^T: act_quant + fp8_gemm -> [M, N] bf16."""
    q, s, backend = _quantised_input(a, w.shape[0], w.shape[1], block)
    return fp8_gemm(q, s, w, scale, ACT_GROUP, block, backend)[: a.shape[0]]


def fp8_linear_grouped(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int]) -> torch.Tensor:
    """x [T, G, I] bf16 through w [G*O, I] as G row blocks (Linear.forward_grouped), W8A8 -> [T, G*O]."""
    T, G, I = x.shape
    O, so = w.shape[0] // G, scale.shape[0] // G
    q, s, backend = _quantised_input(x.reshape(T, G * I), O, I, block)
    gi = I // ACT_GROUP
    ys = [fp8_gemm(q[:, g * I:(g + 1) * I], s[:, g * gi:(g + 1) * gi], w[g * O:(g + 1) * O],
                   scale[g * so:(g + 1) * so], ACT_GROUP, block, backend) for g in range(G)]
    return torch.cat(ys, dim=1)[:T]


def stacked_forward(owner: nn.Module, key: str, parts: tuple[Linear, ...], x: torch.Tensor,
                    fp32: bool = False) -> tuple[torch.Tensor, ...]:
    """Each part's output for the same x (`forward_fp32` when fp32). On CUDA: one GEMM over the
    parts' stacked weights (`fuse_output_rows`, built at the first CUDA call and kept on `owner`
    under `key`, unregistered, so state_dict is unchanged), each output a column view of its
    result. Elsewhere, or when the parts cannot be stacked, each part runs alone."""
    def alone():
        return tuple(p.forward_fp32(x) if fp32 else p(x) for p in parts)

    if not x.is_cuda:
        return alone()
    fused = owner.__dict__.get(key)
    if fused is None or (fused is not False and parts[0].weight.data_ptr() != fused.weight.data_ptr()):
        fused = fuse_output_rows(parts) or False
        owner.__dict__[key] = fused
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()  # the parts' old storage is free once the copy ran
    if fused is False:
        return alone()
    y = fused.forward_fp32(x) if fp32 else fused(x)
    out, col = [], 0
    for p in parts:
        out.append(y[..., col:col + p.out_features])
        col += p.out_features
    return tuple(out)


def fuse_output_rows(parts: tuple[Linear, ...]) -> Linear | None:
    """One Linear whose weight (and FP8 scale) rows are `parts`' stacked in order, for projections
    that read the same input: one GEMM instead of len(parts). Each part's tensors are re-pointed at
    their rows of the stacked ones (views: no memory is duplicated, and in-place weight copies into
    a part reach the fused weight). None when the parts cannot share a GEMM (different input width,
    dtype or quantisation, or FP8 row counts that are not whole scale blocks)."""
    a = parts[0]
    bs = a.block_size
    if any(p.in_features != a.in_features or p.block_size != bs or p.weight.dtype != a.weight.dtype
           or p.weight.device != a.weight.device for p in parts):
        return None
    if bs is not None and (any(p.out_features % bs[0] for p in parts)
                           or any(p.scale.dtype != a.scale.dtype for p in parts)):
        return None
    fused = Linear.__new__(Linear)
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = a.in_features, sum(p.out_features for p in parts)
    fused.block_size = bs
    widened = [p.scale_fp32 for p in parts]  # the parts' prepared W8A8 scales (prepare_fp8_linears), if all have one
    fused.scale_fp32 = torch.cat(widened) if all(w is not None for w in widened) else None
    names = ("weight",) if bs is None else ("weight", "scale")
    for name in names:
        stacked = torch.cat([getattr(p, name).data for p in parts])
        setattr(fused, name, stacked)  # a plain attribute: `fused` is never registered on a module
        row = 0
        for p in parts:
            n = getattr(p, name).shape[0]
            if isinstance(getattr(p, name), nn.Parameter):
                getattr(p, name).data = stacked[row:row + n]
            else:
                setattr(p, name, stacked[row:row + n])
            row += n
    return fused


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear without bias; in batch-invariant mode with fixed row tiles (layers/invariant.py)."""
    return invariant.linear(x, w) if invariant.enabled() else F.linear(x, w)


def matmul_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in fp32, as the reference computes routers and compressors (both
    upcast). bf16 x bf16 products are exact in fp32, so on CUDA one GEMM with fp32 accumulation and
    output gives the same values up to summation order, without an fp32 copy of the weight."""
    if invariant.enabled():
        return invariant.linear_fp32(x, w)
    if x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
    return dense_linear(x.float(), w.float())


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, G, I] @ w [G, O, I]^T per group -> [T, G*O]. Many tokens: one GEMM per group on the
    strided views (the batched einsum picks slower batched kernels at prefill sizes); few tokens: one
    batched launch."""
    if x.shape[0] >= 512 or invariant.enabled():
        return torch.cat([dense_linear(x[:, g], w[g]) for g in range(w.shape[0])], dim=1)
    return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


def expert_tensors(num_experts: int, out_features: int, in_features: int, dtype: torch.dtype,
                   quant: QuantSpec, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Storage for E stacked expert matrices: dense [E, out, in], FP4 packed [E, out, in/2]
    + E8M0 [E, out, in/32], or FP8 [E, out, in] + block scales."""
    if not quant.quantized:
        return torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device), None
    if quant.fp4_experts:
        return (torch.empty(num_experts, out_features, in_features // 2, dtype=torch.int8, device=device),
                torch.empty(num_experts, out_features, in_features // 32, dtype=quant.scale_dtype, device=device))
    bo, bi = quant.block_size
    return (torch.empty(num_experts, out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(num_experts, _cdiv(out_features, bo), _cdiv(in_features, bi),
                        dtype=quant.scale_dtype, device=device))


def dequant_expert(w: torch.Tensor, scale: torch.Tensor | None, quant: QuantSpec,
                   dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w.to(dtype)
    if quant.fp4_experts:
        if w.dtype == torch.float8_e4m3fn:  # repacked for the GPU (Experts.repack_fp4_as_fp8)
            return dequant_fp8_blocks(w, scale, (1, 32), dtype)
        return dequant_fp4(w, scale, 32, dtype)
    return dequant_fp8_blocks(w, scale, quant.block_size, dtype)
