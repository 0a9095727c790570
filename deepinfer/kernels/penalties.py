"""vLLM's repetition, frequency and presence penalties on fp32 logits rows, in place (worker/logits_processors.py).

For processed row p (logits row rows[p], history slot slots[p]) and every token v:
  c    = counts[slots[p], v]                        the output's count of v
  seen = prompt[slots[p], v] != 0 or c > 0          v is in the prompt or the output
  x    = logits[rows[p], v]
  x    = seen ? (x > 0 ? x / rep[p] : x * rep[p]) : x
  x    = x - freq[p] * c
  x    = x - pres[p] * (c > 0)
Each step is rounded on its own (fp32, IEEE division, no fused multiply-add), as `reference` rounds it, so the two
give the same bits. Rows not in `rows` are left as they are. One launch, no host sync.
Grid: (P, cdiv(V, BLOCK)).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK = 1024


def penalized(x: torch.Tensor, c: torch.Tensor, seen: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor,
              pres: torch.Tensor) -> torch.Tensor:
    """The formula on matching shapes (fp32 x, fp32 counts c, bool seen; the penalties broadcast)."""
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * c
    return x - pres * (c > 0).float()


def _check(logits, rows, slots, counts, prompt, rep, freq, pres) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a 2-D float32 tensor, got {tuple(logits.shape)} {logits.dtype}")
    if counts.dim() != 2 or counts.dtype != torch.int32 or counts.shape[1] != logits.shape[1]:
        raise ValueError(f"counts must be int32 [slots, {logits.shape[1]}], got {tuple(counts.shape)} {counts.dtype}")
    if prompt.shape != counts.shape or prompt.dtype != torch.uint8:
        raise ValueError(f"prompt must be uint8 {tuple(counts.shape)}, got {tuple(prompt.shape)} {prompt.dtype}")
    n = rows.shape[0]
    for name, t in (("slots", slots), ("rep", rep), ("freq", freq), ("pres", pres)):
        if t.shape != (n,) or t.device != logits.device:
            raise ValueError(f"{name} must be [{n}] on {logits.device}, got {tuple(t.shape)} on {t.device}")


def reference(logits, rows, slots, counts, prompt, rep, freq, pres) -> None:
    c = counts[slots].float()
    seen = (prompt[slots] != 0) | (c > 0)
    logits[rows] = penalized(logits[rows], c, seen, rep[:, None], freq[:, None], pres[:, None])


if triton is not None:
    @triton.jit
    def _penalties_kernel(logits, rows, slots, counts, prompt, rep, freq, pres, V, s_logits, s_counts, s_prompt,
                          BLOCK: tl.constexpr):
        p = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < V
        row = tl.load(rows + p).to(tl.int64)
        slot = tl.load(slots + p).to(tl.int64)
        x = tl.load(logits + row * s_logits + cols, mask=m, other=0.0)
        c = tl.load(counts + slot * s_counts + cols, mask=m, other=0).to(tl.float32)
        seen = (tl.load(prompt + slot * s_prompt + cols, mask=m, other=0) != 0) | (c > 0)
        r = tl.load(rep + p)
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, r), x * r), x)
        x = x - tl.load(freq + p) * c
        x = x - tl.load(pres + p) * (c > 0).to(tl.float32)
        tl.store(logits + row * s_logits + cols, x, mask=m)


def apply_penalties(logits, rows, slots, counts, prompt, rep, freq, pres) -> None:
    """In place on logits [R, V] fp32: rows [P] int64 (distinct), slots [P] int64 into counts [S, V] int32 and
    prompt [S, V] uint8, rep / freq / pres [P] fp32. One Triton launch on CUDA; `reference` otherwise."""
    _check(logits, rows, slots, counts, prompt, rep, freq, pres)
    if triton is None or not logits.is_cuda or logits.stride(1) != 1 or counts.stride(1) != 1 or prompt.stride(1) != 1:
        return reference(logits, rows, slots, counts, prompt, rep, freq, pres)
    _launch(logits, rows, slots, counts, prompt, rep, freq, pres)


def _launch(logits, rows, slots, counts, prompt, rep, freq, pres) -> None:
    """The launch without the device checks (also runs under TRITON_INTERPRET=1)."""
    P, V = rows.shape[0], logits.shape[1]
    if P == 0 or V == 0:
        return
    # enable_fp_fusion=False: x - freq * c stays a product and a difference, each rounded, as in `reference`
    _penalties_kernel[(P, triton.cdiv(V, BLOCK))](
        logits, rows, slots, counts, prompt, rep, freq, pres, V, logits.stride(0), counts.stride(0),
        prompt.stride(0), BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
