"""DeepSeek-V4 MoE: sqrtsoftplus router (hash-routed or top-k with a selection-only
bias), renormalised weights x routed_scaling_factor, clamped SwiGLU experts + shared expert."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import grouped_gemm_fp8_gluon as gluon_fp8
from deepinfer.kernels import router as _router
from deepinfer.kernels.act_quant import act_quant
from deepinfer.kernels.grouped_gemm import (FP4_GROUP, FP8, fused_layout_error, grouped_gemm, grouped_gemv_fused,
                                            triton_available, use_gemv)
from deepinfer.kernels.grouped_gemm_fp8 import grouped_gemm_fp8, tma_variant_ok
from deepinfer.kernels.moe_align import moe_align
from deepinfer.kernels.moe_combine import moe_combine
from deepinfer.kernels.swiglu import swiglu
from deepinfer.layers import invariant
from deepinfer.layers.linear import (ACT_GROUP, DENSE, Linear, QuantSpec, dense_linear, dequant_expert,
                                    expert_tensors, matmul_fp32, stacked_forward)
from deepinfer.formats.quant import dequant_fp8_blocks, fold_e8m0_groups, unpack_fp4

# Quantised routed experts run W8A8 (activations quantised per 1 x ACT_GROUP with power-of-two scales,
# kernels/act_quant.py, then an FP8 x FP8 grouped GEMM, kernels/grouped_gemm_fp8.py) from this many
# routed rows per expert on average (M >= W8A8_ROWS_PER_EXPERT * num_experts), outside batch-invariant
# mode; fewer rows run W8A16 (kernels/grouped_gemm.py). H200, V4's 256 experts x top-6, one layer
# (benchmarks/results/2026-12-01-h200-fp8-experts-1675cf6.json): at 64 tokens (1.5 rows an expert)
# W8A8 1434 us against W8A16 1686 (folded scales) / 1736 ((1, 32) scales) and bf16 3472; at 2731
# tokens 2677 against 8673 / 5228. Fewer rows were not measured: 1 row an expert lies below the
# smallest measured size (V4-Flash: 43 tokens a step).
W8A8_ROWS_PER_EXPERT = 1
# From this many rows W8A8 runs grouped_gemm_fp8's variant "gluon" where it takes the inputs (sm_90): at V4's
# expert shapes on the H200, 512 / 1024 / 4096 / 8192 tokens x 6, a layer's three projections 1.70 / 1.74 / 2.72 /
# 4.52 ms against variant "tma"'s 1.76 / 1.81 / 3.19 / 5.25 (benchmarks/NOTES.md, "2026-12-02, third session");
# fewer rows not measured.
GLUON_ROWS = 3072
# Up to this many tokens a step, FP8 routed experts whose GEMV reads the shared expert's layout run the shared
# expert as one more group of their GEMVs, w1 and w3 in one launch (Experts.with_shared): three GEMV-side launches
# a layer instead of seven. One token only: the shared group takes one row tile per token, each reading the whole
# shared weight (the separate Linear reads it once).
SHARED_AS_GROUP_TOKENS = 1


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32."""
    return invariant.pointwise(F.silu, gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


class Gate(nn.Module):
    """Router. V4 hash layers select by `tid2eid[token]`; others by top-k of score + bias
    (selection only). V4.1 adds `bias_vl`, used instead of `bias` for image tokens."""

    def __init__(self, dim: int, num_experts: int, topk: int, vocab_size: int, hashed: bool,
                 route_scale: float, dtype: torch.dtype, vision_bias: bool = False):
        super().__init__()
        self.topk, self.route_scale, self.hashed = topk, route_scale, hashed
        self.weight = nn.Parameter(torch.empty(num_experts, dim, dtype=dtype), requires_grad=False)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, topk, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        if vision_bias:
            self.bias_vl = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = matmul_fp32(x, self.weight)
        if _router.supported(logits, self.topk):  # CUDA: one row-local kernel after the GEMM
            if self.hashed:
                return _router.route(logits, self.topk, self.route_scale, input_ids, self.tid2eid)
            vision = image_mask is not None and hasattr(self, "bias_vl")
            return _router.route(logits, self.topk, self.route_scale, bias=self.bias,
                                 bias_vl=self.bias_vl if vision else None, image_mask=image_mask if vision else None)
        scores = invariant.pointwise(F.softplus, logits).sqrt()
        if self.hashed:
            idx = self.tid2eid[input_ids].long()
        else:
            bias = self.bias if image_mask is None else torch.where(image_mask[:, None], self.bias_vl, self.bias)
            idx = torch.topk(scores + bias, self.topk, dim=-1).indices
        w = scores.gather(1, idx)
        return w / invariant.reduce_sum(w, -1).unsqueeze(-1) * self.route_scale, idx


class MLP(nn.Module):
    """Shared expert (FP8 in the checkpoint); clamped like the routed experts, as transformers does."""

    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype, quant: QuantSpec = DENSE):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, dtype, quant)
        self.w2 = Linear(inter, dim, dtype, quant)
        self.w3 = Linear(dim, inter, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton_available():  # w1 + w3 as one GEMM, then one fused pass (kernels/swiglu.py)
            gate, up = stacked_forward(self, "_w1_w3", (self.w1, self.w3), x)
            return self.w2(swiglu(gate, up, self.limit, x.dtype))
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class Experts(nn.Module):
    """Routed experts stacked per projection: w1/w3 [E, F, D], w2 [E, D, F] (+ `*_scale` when quantised)."""

    def __init__(self, dim: int, inter: int, num_experts: int, limit: float, dtype: torch.dtype,
                 quant: QuantSpec = DENSE):
        super().__init__()
        self.num_experts, self.limit, self.quant = num_experts, limit, quant
        # this module holds experts first_expert .. first_expert + num_experts - 1 of num_global (the
        # router's ids); fewer than all when the experts are split over ranks (deepinfer/distributed)
        self.first_expert, self.num_global = 0, num_experts
        for name, (o, i) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            w, s = expert_tensors(num_experts, o, i, dtype, quant)
            if s is None:
                setattr(self, name, nn.Parameter(w, requires_grad=False))
            else:
                self.register_buffer(name, w)
                self.register_buffer(f"{name}_scale", s)

    def _w(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        w, scale = getattr(self, name), getattr(self, f"{name}_scale", None)
        if scale is not None and self.quant.fp4_experts and w.dtype == torch.float8_e4m3fn:  # repacked / folded
            return dequant_fp8_blocks(w[e], scale[e], self._block(name), dtype)
        return dequant_expert(w[e], None if scale is None else scale[e], self.quant, dtype)

    def _block(self, name: str) -> tuple[int, int]:
        """The FP8 scale block of projection `name`: FP4 experts held as FP8 codes have one scale per row
        and (1, 32) inputs as repacked or (1, 128) once folded (fold_scales); others the checkpoint's."""
        if not self.quant.fp4_experts:
            return self.quant.block_size
        w, scale = getattr(self, name), getattr(self, f"{name}_scale")
        return (1, w.shape[-1] // scale.shape[-1]) if w.dtype == torch.float8_e4m3fn else (1, FP4_GROUP)

    def _w8a8(self, name: str, rows: int) -> bool:
        """Whether `rows` expert-sorted rows through projection `name` run W8A8: FP8 codes whose scale
        blocks span whole activation groups along K, W8A8_ROWS_PER_EXPERT rows an expert on average,
        outside batch-invariant mode (one path at every batch there)."""
        w = getattr(self, name)
        if w.dtype != torch.float8_e4m3fn or invariant.enabled():
            return False
        return self._block(name)[1] % ACT_GROUP == 0 and rows >= W8A8_ROWS_PER_EXPERT * self.num_experts

    def _sorted(self, weights: torch.Tensor, idx: torch.Tensor):
        """(weights, order, tok, offs, inv): the (token, slot) pairs sorted by expert, each one's token
        row, the cumulative row end of each of this module's experts (int32, torch._grouped_mm's
        convention) and where each pair landed. No host sync; one launch for small batches
        (deepinfer/kernels/moe_align.py). When this module holds some of the router's experts only,
        pairs routed elsewhere get weight 0 and sort after offs[-1], where no expert computes them."""
        if self.num_experts == self.num_global:
            return (weights, *moe_align(idx, self.num_experts))
        local = idx - self.first_expert
        held = (local >= 0) & (local < self.num_experts)
        order, tok, offs, inv = moe_align(torch.where(held, local, self.num_experts), self.num_experts + 1)
        return torch.where(held, weights, 0.0), order, tok, offs[:self.num_experts], inv

    def _grouped_mm(self, xs: torch.Tensor | None, name: str, offs: torch.Tensor,
                    qx: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """xs [M, K] bf16 through projection `name`'s experts. `qx`: act_quant(xs, ACT_GROUP), given when
        W8A8 applies to this projection (`_w8a8`), which then multiplies it instead of xs (None then)."""
        w, scale = getattr(self, name), getattr(self, f"{name}_scale", None)
        if qx is not None and self._w8a8(name, qx[0].shape[0]):
            block = self._block(name)
            variant = "tma" if tma_variant_ok(qx[0], w) else "pointer"  # TMA: 12-15 % faster where it applies
            if qx[0].shape[0] >= GLUON_ROWS and gluon_fp8.takes(*qx, w, scale, ACT_GROUP, block):
                variant = "gluon"
            return grouped_gemm_fp8(*qx, w, scale, offs, ACT_GROUP, block, variant=variant)
        tiles = invariant.gemm_tiles()  # batch-invariant mode: one tiling for every row count
        if scale is None:
            if xs.shape[0] <= 16 * self.num_experts or tiles:  # decode: the Triton kernel streams weights faster
                return grouped_gemm(xs, w, offs, **tiles)
            return torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
        return grouped_gemm(xs, w, offs, scale, self._block(name), **tiles)

    def _inputs(self, x: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor | None, tuple | None]:
        """The expert-sorted rows x[tok] for w1 and w3: (bf16 rows, or None when both run W8A8;
        act_quant's (q, s) of them when either runs W8A8, else None). act_quant is row-local, so the T
        tokens are quantised once and their codes gathered (top-k times fewer rows quantised, and no
        bf16 gather)."""
        rows = tok.shape[0]
        w8a8 = [self._w8a8(n, rows) for n in ("w1", "w3")]
        qx = None
        if any(w8a8):
            q, s = act_quant(x, ACT_GROUP)
            qx = (q[tok], s[tok])
        return (None if all(w8a8) else x[tok]), qx

    @torch.no_grad()
    def repack_fp4_as_fp8(self, fold: bool = True) -> None:
        """FP4 experts -> FP8 e4m3 codes with the same E8M0 scale per 32 inputs (block (1, 32)). Exact:
        every e2m1 value is an e4m3 value. Twice the bytes, but the GPU kernel decodes e4m3 in
        hardware, where e2m1 costs ALU work: on the H200, V4 Flash slice, one run, packed FP4 experts
        took 13.6 ms per decode step at batch 64 and 320 ms per 4 x 2048 prefill, repacked 9.19 / 101 ms
        (benchmarks/results/2026-12-01-NVIDIA-H200-14a04f6.json). The engine repacks where the
        repacked model fits (LLM: engine/memory_fit.py repack_fits). The scales are then folded to one per
        (1, 128) where exact (fold_scales: fewer scale bytes, and the W8A8 prefill path); fold=False leaves
        that to the caller (repack_fp4_experts with `agree`: one decision across ranks)."""
        if not self.quant.fp4_experts:
            return
        for name in ("w1", "w2", "w3"):
            packed = getattr(self, name)
            if packed.dtype == torch.float8_e4m3fn:
                continue
            fp8 = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=torch.float8_e4m3fn,
                              device=packed.device)
            for e in range(packed.shape[0]):  # one expert at a time bounds the fp32 temporary
                fp8[e] = unpack_fp4(packed[e]).to(torch.float8_e4m3fn)
            setattr(self, name, fp8)
        if fold:
            self.fold_scales()

    @torch.no_grad()
    def fold_scales(self, only: frozenset[str] | None = None) -> dict[str, bool]:
        """FP4 experts held as FP8 codes: each projection's E8M0 scales per (1, 32) -> per (1, 128) where
        that is exact for every expert (formats/quant.py fold_e8m0_groups), in place: the folded codes
        and scales are the only copy. -> {projection: folded}; a projection that would lose a bit keeps
        its (1, 32) scales (W8A16 at every size). Both forms feed the W8A16 kernel (a (1, 128) scale
        covers its K tiles, which divide 128, and scales the tile's product instead of each weight); the
        (1, 128) form also feeds W8A8 (one scale per activation group). One expert at a time bounds the
        temporaries: every expert is checked before any is rewritten. `only`: the projections that may be
        folded (others keep their scales and report False unless folded already)."""
        done = self.foldable()
        for name, ok in done.items():
            w, scale = getattr(self, name), getattr(self, f"{name}_scale")
            if not ok or self._block(name) != (1, FP4_GROUP) or (only is not None and name not in only):
                done[name] = ok and self._block(name) != (1, FP4_GROUP)
                continue
            folded = torch.empty(*scale.shape[:-1], scale.shape[-1] // 4, dtype=scale.dtype, device=scale.device)
            for e in range(w.shape[0]):
                w[e], folded[e] = fold_e8m0_groups(w[e], scale[e])
            setattr(self, f"{name}_scale", folded)
        return done

    @torch.no_grad()
    def foldable(self) -> dict[str, bool]:
        """FP4 experts held as FP8 codes: {projection: whether its scales are per (1, 128) already or fold
        there exactly for every expert}; {} for other experts. Nothing is rewritten."""
        done = {}
        if not self.quant.fp4_experts:
            return done
        for name in ("w1", "w2", "w3"):
            w, scale = getattr(self, name), getattr(self, f"{name}_scale")
            if w.dtype != torch.float8_e4m3fn or self._block(name) != (1, FP4_GROUP):
                done[name] = w.dtype == torch.float8_e4m3fn and self._block(name)[1] % ACT_GROUP == 0
            else:
                done[name] = all(fold_e8m0_groups(w[e], scale[e]) is not None for e in range(w.shape[0]))
        return done

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """GPU path: one grouped GEMM per projection over the tokens sorted by expert, offsets kept on
        the device: no host sync, no Python loop. Dense bf16 experts use torch._grouped_mm, quantised
        (FP8, FP4 packed or repacked as FP8) ones the Triton kernel that dequantises while loading
        (bf16 activations), or at prefill sizes (`_w8a8`) the FP8 x FP8 kernel on activations
        quantised per 1 x 128.
        -> fp32 [T, D]; with `shared` (the shared expert's output) the layer's result
        (sum + float(shared)).to(x.dtype), added inside the combine kernel."""
        weights, order, tok, offs, inv = self._sorted(weights, idx)
        xs, qx = self._inputs(x, tok)  # W8A8 (prefill sizes): w1 and w3 read one quantised copy
        gate = self._grouped_mm(xs, "w1", offs, qx)
        up = self._grouped_mm(xs, "w3", offs, qx)
        fused = x.is_cuda and triton_available()  # one pass each, k slots summed in slot order (batch-invariant)
        h = swiglu(gate, up, self.limit, x.dtype) if fused else clamped_swiglu(gate, up, self.limit).to(x.dtype)
        y = self._grouped_mm(h, "w2", offs, act_quant(h, ACT_GROUP) if self._w8a8("w2", h.shape[0]) else None)
        if self.num_experts != self.num_global:  # rows past offs[-1] (other experts' pairs) are unwritten
            y = y.masked_fill((torch.arange(y.shape[0], device=y.device) >= offs[-1])[:, None], 0)
        if fused:
            return moe_combine(y, order, weights, idx.shape[1], inv, shared,
                               torch.float32 if shared is None else x.dtype)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y.float() * weights.flatten()[order, None])
        return out if shared is None else (out + shared.float()).to(x.dtype)

    def with_shared(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, shared: "MLP") -> torch.Tensor | None:
        """The layer's result (routed sum + shared expert, x.dtype) with the shared expert as group E of the
        routed experts' GEMVs (grouped_gemv_fused: w1 and w3 in one launch, then w2), or None where that does not
        apply: CUDA bf16 outside batch-invariant mode, at most SHARED_AS_GROUP_TOKENS tokens, all of this
        module's experts, FP8 codes with E8M0 scales in the GEMV's regime, and a shared expert of one expert's
        shape whose FP8 scales share their K blocks. Same kernels' arithmetic per element as `grouped` plus
        MLP.forward, with the GEMV tiles of E + 1 groups; the combine adds the shared row last, as there."""
        T = x.shape[0]
        if not (x.is_cuda and x.dtype == torch.bfloat16 and triton_available() and 0 < T <= SHARED_AS_GROUP_TOKENS
                and not invariant.enabled() and self.num_experts == self.num_global):
            return None
        if not self.quant.quantized or any(getattr(self, n).dtype != torch.float8_e4m3fn for n in ("w1", "w2", "w3")):
            return None
        E, k = self.num_experts, idx.shape[1]
        (w1, s1), (w3, s3), (w2, s2) = ((getattr(self, n), getattr(self, f"{n}_scale")) for n in ("w1", "w3", "w2"))
        b13, b2 = self._block("w1"), self._block("w2")
        up = ((shared.w1.weight, shared.w1.scale), (shared.w3.weight, shared.w3.scale))
        down = (shared.w2.weight, shared.w2.scale)
        lins = (shared.w1, shared.w3, shared.w2)
        if (self._block("w3") != b13 or any(m.block_size is None for m in lins)
                or shared.w1.block_size != shared.w3.block_size
                or not use_gemv(T * (k + 1), E + 1, FP8)
                or fused_layout_error(w1, s1, E + 1, (w3, s3), up, shared.w1.block_size, b13)
                or fused_layout_error(w2, s2, E + 1, None, down, shared.w2.block_size, b2)):
            return None
        order, tok, offs, inv = moe_align(idx, E + 1, shared_slot=True)
        gate_up = grouped_gemv_fused(x[tok], w1, s1, offs, b13, pair=(w3, s3), extra=up,
                                     extra_block=shared.w1.block_size)
        F_ = w1.shape[1]
        h = swiglu(gate_up[:, :F_], gate_up[:, F_:], self.limit, x.dtype)
        y = grouped_gemv_fused(h, w2, s2, offs, b2, extra=down, extra_block=shared.w2.block_size)
        # group E's rows are the last T (the largest id; stable sort keeps token order): the shared outputs
        return moe_combine(y, order, weights, k, inv, y[T * k:], x.dtype, inv_stride=k + 1)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if not (x.is_cuda and x.dtype == torch.bfloat16):
            return False
        return triton_available() if self.quant.quantized else hasattr(torch, "_grouped_mm")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens grouped by expert; each token's k outputs summed in fp32 -> [T, D] fp32, or with
        `shared` (the shared expert's output) (sum + float(shared)).to(x.dtype). Grouped GEMMs on the
        GPU for bf16 activations (dense or quantised experts); the reference loop on the CPU and for fp32."""
        if self._use_grouped(x):
            return self.grouped(x, weights, idx, shared)
        weights, order, tok, offs, _ = self._sorted(weights, idx)
        bounds = [0] + offs.tolist()
        w = weights.flatten()[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            start, end = bounds[e], bounds[e + 1]
            if end == start:
                continue
            t = tok[start:end]
            xe = x[t]
            h = clamped_swiglu(dense_linear(xe, self._w("w1", e, x.dtype)), dense_linear(xe, self._w("w3", e, x.dtype)),
                               self.limit).to(x.dtype)
            out.index_add_(0, t, dense_linear(h, self._w("w2", e, x.dtype)).float() * w[start:end, None])
        return out if shared is None else (out + shared.float()).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, dim: int, inter: int, num_experts: int, topk: int, n_shared: int, vocab_size: int,
                 hashed: bool, route_scale: float, limit: float, dtype: torch.dtype,
                 expert_quant: QuantSpec = DENSE, shared_quant: QuantSpec = DENSE, vision_bias: bool = False):
        super().__init__()
        self.gate = Gate(dim, num_experts, topk, vocab_size, hashed, route_scale, dtype, vision_bias)
        self.experts = Experts(dim, inter, num_experts, limit, dtype, expert_quant)
        self.shared_experts = MLP(dim, inter * n_shared, limit, dtype, shared_quant)
        # set by an expert-parallel engine (deepinfer/distributed): a callable with Experts.forward's
        # signature that runs the routed experts across ranks; None: `experts` runs them here
        self.expert_parallel = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None):
        weights, idx = self.gate(x, input_ids, image_mask)
        if self.expert_parallel is None:
            fused = self.experts.with_shared(x, weights, idx, self.shared_experts)
            if fused is not None:
                return fused
        routed = self.experts if self.expert_parallel is None else self.expert_parallel
        return routed(x, weights, idx, self.shared_experts(x))


def repack_fp4_experts(model: nn.Module, agree: Callable[[list[bool]], list[bool]] | None = None) -> None:
    """Experts.repack_fp4_as_fp8 on every routed-expert module of `model` (others are left alone).
    `agree` (ranks of one engine, each holding part of every MoE's experts): takes this rank's list of
    Experts.foldable flags (modules in model order x w1, w2, w3) and returns the flags every rank agreed
    on, so each projection's scales take one form on all ranks (EPLB moves expert rows between them)."""
    mods = [m for m in model.modules() if isinstance(m, Experts)]
    if agree is None:
        for m in mods:
            m.repack_fp4_as_fp8()
        return
    for m in mods:
        m.repack_fp4_as_fp8(fold=False)
    names = ("w1", "w2", "w3")
    flags = agree([m.foldable().get(n, False) for m in mods for n in names])
    for i, m in enumerate(mods):
        m.fold_scales(frozenset(n for j, n in enumerate(names) if flags[3 * i + j]))
