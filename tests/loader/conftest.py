from __future__ import annotations

import torch
import pytest
from torch import nn

from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks, quant_fp4, quant_fp8_blocks
from deepinfer.loader.names import split_expert_name
from deepinfer.tools.make_checkpoint import PRESETS, random_weights, weight_specs, write_checkpoint


def _set(root: nn.Module, name: str, t: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if t.is_floating_point() and t.dtype.itemsize > 1:
        mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    else:
        mod.register_buffer(leaf, t)


def build_toy(config: dict, *, dtype: torch.dtype = torch.float32, quantized: bool = False) -> nn.Module:
    """A module whose state_dict follows the loader contract, filled with NaN/-1 sentinels.
    quantized: FP8 linears keep `X.scale`, routed experts keep `experts.wN` + `wN_scale`."""
    bo, bi = config["quantization_config"]["weight_block_size"]
    n_exp = config["n_routed_experts"]
    root = nn.Module()
    for spec in weight_specs(config):
        shape = spec.shape
        split = split_expert_name(spec.name)
        if split is not None:
            stem, e, proj, _ = split
            if e:
                continue
            if quantized:
                _set(root, f"{stem}.{proj}", torch.full((n_exp, *shape[:-1], shape[-1] // 2), -1, dtype=torch.int8))
                _set(root, f"{stem}.{proj}_scale",
                     torch.zeros((n_exp, *shape[:-1], shape[-1] // 32), dtype=torch.uint8))
            else:
                _set(root, f"{stem}.{proj}", torch.full((n_exp, *shape), float("nan"), dtype=dtype))
        elif spec.store == "int32":
            _set(root, spec.name, torch.full(shape, -1, dtype=torch.int64))
        elif quantized and spec.store == "fp8":
            _set(root, spec.name, torch.zeros(shape, dtype=torch.float8_e4m3fn))
            stem = spec.name[: -len(".weight")]
            _set(root, f"{stem}.scale", torch.zeros((-(-shape[0] // bo), -(-shape[1] // bi)),
                                                    dtype=torch.float8_e8m0fnu))
        else:
            _set(root, spec.name, torch.full(shape, float("nan"), dtype=dtype))
    return root


def expected_dense(config: dict, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What an fp8 checkpoint written by make_checkpoint dequantises to, in the toy's names."""
    block = tuple(config["quantization_config"]["weight_block_size"])
    specs = {s.name: s for s in weight_specs(config)}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list] = {}
    for name, t in random_weights(config, seed):
        store = specs[name].store
        if store == "fp8":
            v = dequant_fp8_blocks(*quant_fp8_blocks(t, block), block)
        elif store == "expert":
            v = dequant_fp4(*quant_fp4(t, 32), 32)
        elif store == "bf16":
            v = t.bfloat16().float()
        elif store == "int32":
            v = t.long()
        else:
            v = t
        v = v if store == "int32" else v.to(dtype)
        split = split_expert_name(name)
        if split is not None:
            stem, e, proj, _ = split
            experts.setdefault(f"{stem}.{proj}", []).append(v)
        else:
            out[name] = v
    out.update({k: torch.stack(v) for k, v in experts.items()})
    return out


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    return PRESETS["tiny"]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_config):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny_config, seed=3)


@pytest.fixture
def toy():
    return build_toy


@pytest.fixture
def expected():
    return expected_dense
