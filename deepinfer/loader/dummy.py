"""load_format="dummy" (vLLM's name): the model is built from config.json alone and every tensor the
checkpoint would fill gets random values on its device; no weight file is read or needed.

For throughput and memory measurements of checkpoints that are not at hand (a released model's
config.json is enough), never for outputs. The tensors keep the formats a real load gives them (FP8
blocks, E8M0 scales, packed FP4 experts when `quantized`), so memory and kernels are the real ones.

Values, by the tensor's dtype (each tensor drawn from its own generator, seeded from `seed` and its
name, so a load is reproducible and does not depend on the order tensors are visited):
  * e4m3 weights: standard normal codes; E8M0 scales: 2^-6, so a weight's standard deviation is about
    2^-6, near an initialised model's;
  * packed FP4 experts (int8): uniform bytes (every nibble is an e2m1 code);
  * other floating tensors: norms' weights 1, everything else N(0, 0.02);
  * V4 hash routing tables (`tid2eid`): for each token, `topk` distinct experts of its gate's;
  * any other integer tensor: a ValueError naming it (no rule can guess what it indexes).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

DUMMY_SCALE_EXPONENT = -6  # 2^-6: block scales of dummy FP8 / FP4 weights
_E8M0 = (torch.float8_e8m0fnu, torch.uint8)


class DummyWeights:
    """Stands where a CheckpointReader stands (load_weights, model_spec): it names no tensors, and
    load_weights fills the model with `fill_dummy` instead of reading."""

    def __init__(self, model_dir: str | Path, seed: int = 0):
        self.dir, self.seed = Path(model_dir), seed

    def names(self) -> list[str]:
        return []


def fill_dummy(targets: dict[str, torch.Tensor], seed: int) -> None:
    """Random values (module docstring) into every tensor of `targets` (a model's state_dict with
    keep_vars, every tensor with storage)."""
    with torch.no_grad():
        for key, t in targets.items():
            g = torch.Generator(t.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            _fill(key, t, targets, g)


def _fill(key: str, t: torch.Tensor, targets: dict[str, torch.Tensor], g: torch.Generator) -> None:
    if t.dtype == torch.float8_e4m3fn:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.bfloat16).clamp_(-448, 448))
    elif t.dtype in _E8M0:
        t.view(torch.uint8).fill_(127 + DUMMY_SCALE_EXPONENT)
    elif t.dtype == torch.int8:
        t.copy_(torch.randint(-128, 128, t.shape, generator=g, device=t.device, dtype=torch.int8))
    elif t.is_floating_point():
        if key.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).mul_(0.02))
    elif key.endswith(".tid2eid"):
        gate = targets[key[: -len("tid2eid")] + "weight"]
        draws = torch.rand(t.shape[0], gate.shape[0], generator=g, device=t.device)
        t.copy_(draws.argsort(dim=1)[:, : t.shape[1]])  # topk distinct experts per token
    else:
        raise ValueError(f"load_format='dummy': no rule for {key} ({t.dtype}, shape {tuple(t.shape)}); "
                         "its values index something a random draw cannot know")
