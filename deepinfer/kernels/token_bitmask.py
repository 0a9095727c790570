"""Token bitmask on logits, in place (structured outputs).

For logits [R, V] and an int32 bitmask [R', W] (32 token ids per word, bit v % 32 of word v // 32):
  logits[r, v] = -inf   where bit v of bitmask[rows[r]] (rows given) or of bitmask[r] is 0,
                        and for every v >= 32 * W
Other entries are left as they are (only the disallowed ones are written). No host sync, fixed
launch shape for fixed shapes: capturable in a CUDA graph.
Grid: (R, cdiv(V, BLOCK)).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

BLOCK = 1024


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor, got {tuple(logits.shape)} {logits.dtype}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.device != logits.device:
        raise ValueError(f"bitmask must be a 2-D int32 tensor on {logits.device}, got "
                         f"{tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}")
    if rows is None:
        if bitmask.shape[0] < logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows (no rows given)")
    elif rows.dim() != 1 or rows.shape[0] != logits.shape[0] or rows.device != logits.device:
        raise ValueError(f"rows must be a 1-D tensor of {logits.shape[0]} indices on {logits.device}, got "
                         f"{tuple(rows.shape)} on {rows.device}")


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    masks = bitmask if rows is None else bitmask[rows]
    masks = masks[:logits.shape[0]]
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = ((masks.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [R, 32 W]
    n = min(logits.shape[1], bits.shape[1])
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[:, :n] = bits[:, :n]
    logits.masked_fill_(~allowed, float("-inf"))


if triton is not None:
    @triton.jit
    def _token_bitmask_kernel(logits, bitmask, rows, V, W, s_logits, s_mask, HAS_ROWS: tl.constexpr,
                              BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if HAS_ROWS:
            row = tl.load(rows + r).to(tl.int64)
        else:
            row = r
        words = cols // 32
        word = tl.load(bitmask + row * s_mask + words, mask=words < W, other=0)
        bit = (word >> (cols % 32)) & 1  # arithmetic shift: bit 31 of a negative word reads as 1 too
        ninf = tl.full([BLOCK], float("-inf"), tl.float32)
        tl.store(logits + r * s_logits + cols, ninf.to(logits.dtype.element_ty), mask=(cols < V) & (bit == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: -inf where the row's mask bit is 0 (or the id is past 32 * W). rows: int64 [R], the
    bitmask row of each logits row (None: row r). One Triton launch on CUDA; `reference` otherwise."""
    _check(logits, bitmask, rows)
    if triton is None or not logits.is_cuda or logits.stride(1) != 1 or bitmask.stride(1) != 1:
        return reference(logits, bitmask, rows)
    _launch(logits, bitmask, rows)


def _launch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """The launch without the device checks (also runs under TRITON_INTERPRET=1)."""
    R, V = logits.shape
    if R == 0 or V == 0:
        return
    _token_bitmask_kernel[(R, triton.cdiv(V, BLOCK))](
        logits, bitmask, rows if rows is not None else bitmask, V, bitmask.shape[1], logits.stride(0),
        bitmask.stride(0), HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=4)
