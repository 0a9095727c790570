"""Dequantisation recipes checked against hand-written bytes."""
from __future__ import annotations

import torch

from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks, scale_to_float


def _e8m0(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e8m0_decode():
    s = _e8m0([127, 128, 126, 0, 254])
    assert scale_to_float(s).tolist() == [1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** 127]
    assert scale_to_float(s.view(torch.uint8)).tolist()[:3] == [1.0, 2.0, 0.5]


def test_fp4_nibble_order_and_sign():
    # byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) is column 1.
    # byte 0x9F: low nibble 0xF (-6.0), high nibble 0x9 (-0.5); 0x08 = -0.0 then +0.0.
    packed = torch.tensor([[0x21, 0x9F] + [0x08] + [0x00] * 13,
                           [0x7A] + [0x00] * 15], dtype=torch.uint8).view(torch.int8)
    out = dequant_fp4(packed, _e8m0([[127], [128]]), 32)
    assert out.shape == (2, 32)
    assert out[0, :6].tolist() == [0.5, 1.0, -6.0, -0.5, -0.0, 0.0]
    assert torch.signbit(out[0, 4]) and not torch.signbit(out[0, 5])
    # row 1: scale 2^(128-127) = 2; 0x7A -> low 0xA (-1.0), high 0x7 (6.0)
    assert out[1, :2].tolist() == [-2.0, 12.0]


def test_fp4_group_of_32_scales():
    packed = torch.full((1, 32), 0x22, dtype=torch.uint8).view(torch.int8)  # every value 1.0
    out = dequant_fp4(packed, _e8m0([[126, 130]]), 32)
    assert out[0, :32].unique().tolist() == [0.5]
    assert out[0, 32:].unique().tolist() == [8.0]


def test_fp8_ragged_last_block():
    # e4m3 byte 0x38 = 1.0; weight [3, 5] with block [2, 4] -> scale grid [2, 2], last block ragged.
    w = torch.full((3, 5), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w.view(torch.uint8)[2, 4] = 0xBC  # -1.5
    out = dequant_fp8_blocks(w, _e8m0([[127, 128], [129, 126]]), (2, 4))
    assert out.tolist() == [[1, 1, 1, 1, 2], [1, 1, 1, 1, 2], [4, 4, 4, 4, -0.75]]


def test_fp8_float32_scales():
    w = torch.full((2, 3), 0x40, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2.0
    out = dequant_fp8_blocks(w, torch.tensor([[0.25, 3.0]]), (2, 2))
    assert out.tolist() == [[0.5, 0.5, 6.0], [0.5, 0.5, 6.0]]
