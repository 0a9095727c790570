"""Triton kernels, one op per file beside its torch reference; shared launch helpers here."""
from __future__ import annotations

import os

import torch

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs a driver call)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
