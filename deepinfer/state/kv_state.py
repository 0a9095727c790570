"""Decode-time state tensors of one attention layer, and the formats they are stored in.

Rows are addressed by flat indices computed by the ForwardBatch planner:
  window ring   row = slot * W' + pos % W'        (last W raw tokens' kv, per request)
  entries       row = entry address (per-request region of the pool)
  index keys    same addresses as the layer's entries
  carry         row = slot * S' + pos % S'        (compressor projections of the open
                                                   window(s); S = 2m with overlap, else m)
with W' = W + ring_slack, S' = S + ring_slack (V4Cache.ring_slack: spare rows so a step's
last positions can be taken back, see state/forward_batch.py).
A row is only ever read after it was written for the same request, so slots need no reset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels import group_fp8
from deepinfer.kernels.copy_rows import copy_rows
from deepinfer.kernels.entry_quant import entry_encode, entry_roundtrip, group_size, reference_decode
from deepinfer.kernels.index_query import index_keys, index_query
from deepinfer.formats import group_quant
from deepinfer.formats.quant import dequant_fp4

EXACT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NORM_DTYPES = (torch.bfloat16, torch.float32)  # rows entry_quant's norm path takes
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float32")


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """"auto" = the formats the model was trained with (QAT: "fp8" names them); the exact formats keep values."""
    if kv_cache_dtype == "auto":
        return "fp8"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


class RowStore:
    """A store of rows; `data` is the exact-format tensor (absent when the rows are encoded)."""

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        raise NotImplementedError

    def write_from(self, rows: torch.Tensor, x: torch.Tensor, src: torch.Tensor) -> None:
        """write(rows, x[src]); rows kept exactly in x's dtype are copied by one kernel on CUDA."""
        data = getattr(self, "data", None)
        if data is not None and x.dtype == data.dtype and x.dim() == 2:
            copy_rows(((data, x),), rows, src)
        else:
            self.write(rows, x[src])

    def norm_roundtrip(self, x: torch.Tensor, norm: tuple, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """RMSNorm + RoPE of x (norm = (weight, eps, cos, sin): kernels/entry_quant.py) and its round trip, with
        row i also written at rows[i] when given, in one launch where the format has such a kernel (EntryStore
        "fp8"; the torch form on the CPU); None elsewhere: nothing is computed or written."""
        return None

    def write_normed(self, rows: torch.Tensor, x: torch.Tensor, norm: tuple) -> bool:
        """write(rows, RMSNorm + RoPE of x) in one launch where the format has such a kernel (as norm_roundtrip);
        False elsewhere: nothing is written."""
        return False


class EntryStore(RowStore):
    """Rows of head_dim vectors (window kv or compressed entries).

    "fp8": the nope dims as e4m3 with a power-of-two (E8M0) scale per group of 64
    (gcd(64, nope) for narrow test models), the rope dims as bf16 — DeepSeek's QAT format.
    "float32"/"bfloat16": exact values.
    """

    def __init__(self, rows: int, dim: int, rope_dim: int, fmt: str, device):
        self.fmt, self.dim, self.nope = fmt, dim, dim - rope_dim
        if fmt == "fp8":
            self.group = group_size(self.nope)
            self.nope_q = torch.zeros(rows, self.nope, dtype=torch.float8_e4m3fn, device=device)
            self.nope_scale = torch.zeros(rows, self.nope // self.group, dtype=torch.uint8, device=device)
            self.rope = torch.zeros(rows, rope_dim, dtype=torch.bfloat16, device=device)
        else:
            self.data = torch.zeros(rows, dim, dtype=EXACT_FORMATS[fmt], device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.nope_q, self.nope_scale, self.rope] if self.fmt == "fp8" else [self.data]

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        if self.fmt == "fp8":  # one launch on CUDA (kernels/entry_quant.py), torch elsewhere
            entry_encode(x, self.dim - self.nope, self.tensors(), rows)
        else:
            self.data[rows] = x.to(self.data.dtype)

    def write_from(self, rows: torch.Tensor, x: torch.Tensor, src: torch.Tensor) -> None:
        if self.fmt == "fp8":  # the gather x[src] is read by the same launch
            entry_encode(x, self.dim - self.nope, self.tensors(), rows, src)
        else:
            super().write_from(rows, x, src)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "fp8":
            return reference_decode(self.nope_q[rows], self.nope_scale[rows], self.rope[rows], dtype)
        return self.data[rows].to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a write followed by a read returns, for values used before they are stored."""
        if self.fmt == "fp8":
            return entry_roundtrip(x, self.dim - self.nope)
        return x.to(self.data.dtype).to(x.dtype)

    def norm_roundtrip(self, x: torch.Tensor, norm: tuple, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.fmt == "fp8" and x.dtype in NORM_DTYPES:  # the codes written are those the round trip decodes
            return entry_roundtrip(x, self.dim - self.nope, None if rows is None else self.tensors(), rows, norm=norm)
        return None

    def write_normed(self, rows: torch.Tensor, x: torch.Tensor, norm: tuple) -> bool:
        if self.fmt == "fp8" and x.dtype in NORM_DTYPES:
            entry_encode(x, self.dim - self.nope, self.tensors(), rows, norm=norm)
            return True
        return False


class IndexKeyStore:
    """Lightning-indexer keys. "fp4": Hadamard-rotated, then E2M1 with an E8M0 scale per 32,
    packed two per byte (the reference's QAT simulation, stored). Exact formats skip the
    rotation (it is orthogonal, so scores are unchanged in exact arithmetic)."""

    def __init__(self, rows: int, dim: int, fmt: str, device):
        self.fmt = fmt
        if fmt == "fp4":
            self.packed = torch.zeros(rows, dim // 2, dtype=torch.int8, device=device)
            self.scale = torch.zeros(rows, dim // 32, dtype=torch.uint8, device=device)
        else:
            self.data = torch.zeros(rows, dim, dtype=EXACT_FORMATS[fmt], device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale] if self.fmt == "fp4" else [self.data]

    def write(self, rows: torch.Tensor, k: torch.Tensor) -> None:
        if self.fmt == "fp4":
            self.packed[rows], self.scale[rows] = index_keys(k)  # quant_fp4(hadamard(k.float()), 32)
        else:
            self.data[rows] = k.to(self.data.dtype)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "fp4":
            return dequant_fp4(self.packed[rows], self.scale[rows], 32, dtype)
        return self.data[rows].to(dtype)

    def prepare_query(self, q: torch.Tensor) -> torch.Tensor:
        """Queries go through the same rotation + FP4 rounding as the keys (one kernel on CUDA, bit-equal
        to fp4_roundtrip(hadamard(q.float()), 32).to(q.dtype))."""
        if self.fmt == "fp4":
            return index_query(q)
        return q


class FormatStore(RowStore):
    """Rows stored in one of V4.1's cache formats (group_quant: fp8 / mxfp4 / nvfp4) or exactly."""

    def __init__(self, rows: int, dim: int, fmt: str, device):
        self.fmt = fmt
        if fmt in EXACT_FORMATS:
            self.data = torch.zeros(rows, dim, dtype=EXACT_FORMATS[fmt], device=device)
            return
        codes, scale = group_quant.encode(torch.zeros(1, dim, device="meta"), fmt)
        self.codes = torch.zeros(rows, codes.shape[-1], dtype=codes.dtype, device=device)
        self.scale = torch.zeros(rows, scale.shape[-1], dtype=scale.dtype, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] if self.fmt in EXACT_FORMATS else [self.codes, self.scale]

    # "fp8" (V4.1's `auto` window and entry format): one launch each on CUDA (kernels/group_fp8.py), torch elsewhere

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        if self.fmt in EXACT_FORMATS:
            self.data[rows] = x.to(self.data.dtype)
        elif self.fmt == "fp8":
            group_fp8.encode_rows(x, self.codes, self.scale, rows)
        else:
            self.codes[rows], self.scale[rows] = group_quant.encode(x, self.fmt)

    def write_from(self, rows: torch.Tensor, x: torch.Tensor, src: torch.Tensor) -> None:
        if self.fmt == "fp8":  # the gather x[src] is read by the same launch
            group_fp8.encode_rows(x, self.codes, self.scale, rows, src)
        else:
            super().write_from(rows, x, src)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt in EXACT_FORMATS:
            return self.data[rows].to(dtype)
        if self.fmt == "fp8":
            return group_fp8.decode_rows(self.codes, self.scale, rows, dtype)
        return group_quant.decode(self.codes[rows], self.scale[rows], self.fmt, dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt in EXACT_FORMATS:
            return x.to(self.data.dtype).to(x.dtype)
        if self.fmt == "fp8":
            return group_fp8.roundtrip(x)
        return group_quant.roundtrip(x, self.fmt)


@dataclass
class CarryState:
    """Compressor projections (kv, gate score + ape) of the last S positions, fp32."""

    kv: torch.Tensor
    score: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv, self.score]

    @classmethod
    def empty(cls, rows: int, width: int, device) -> "CarryState":
        z = lambda: torch.zeros(rows, width, dtype=torch.float32, device=device)  # noqa: E731
        return cls(z(), z())


@dataclass
class LayerCache:
    ring: EntryStore | FormatStore
    entries: EntryStore | FormatStore | None = None
    index_keys: IndexKeyStore | FormatStore | None = None
    carry: dict[str, CarryState] = field(default_factory=dict)
    ratio: int = 0

    def per_slot(self) -> list[torch.Tensor]:
        return self.ring.tensors() + [t for c in self.carry.values() for t in c.tensors()]

    def paged(self) -> list[torch.Tensor]:
        stores = [s for s in (self.entries, self.index_keys) if s is not None]
        return [t for s in stores for t in s.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.per_slot() + self.paged())
