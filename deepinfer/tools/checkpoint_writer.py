"""What the DeepSeek-V4 and V4.1 checkpoint writers share: the weight spec, the blocks both
architectures have (attention projections, experts, DSpark heads), random initial values, how a
tensor is stored on disk, and the sharded safetensors output with its index."""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from deepinfer.formats.quant import quant_fp4, quant_fp8_blocks, scale_to_float
from deepinfer.loader.checkpoint import INDEX_FILE

DTYPES = ("fp8", "bfloat16", "float32")
FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0"}


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # linear | embed | head | norm | hc_fn | hc_base | hc_scale | sink | ape | bias | tid2eid
    store: str  # fp8 (block-quantised) | fp8_rows (e4m3, one scale per row x 32 columns) | expert (fp4 or fp8)
    #             | bf16 | fp32 | int32


def expert_specs(p: str, n_experts: int, f: int, fs: int, d: int) -> list:
    """Routed experts `ffn.experts.J.w1/w2/w3` (width f) and the shared expert (width fs)."""
    S = WeightSpec
    out = []
    for j in range(n_experts):
        out += [S(f"{p}ffn.experts.{j}.w1.weight", (f, d), "linear", "expert"),
                S(f"{p}ffn.experts.{j}.w2.weight", (d, f), "linear", "expert"),
                S(f"{p}ffn.experts.{j}.w3.weight", (f, d), "linear", "expert")]
    return out + [S(f"{p}ffn.shared_experts.w1.weight", (fs, d), "linear", "fp8"),
                  S(f"{p}ffn.shared_experts.w2.weight", (d, fs), "linear", "fp8"),
                  S(f"{p}ffn.shared_experts.w3.weight", (fs, d), "linear", "fp8")]


def attention_specs(p: str, d: int, ql: int, h: int, dh: int, g: int, ol: int) -> list:
    """The attention projections every V4 / V4.1 block has (compressor / indexer aside)."""
    S = WeightSpec
    return [S(f"{p}attn.wq_a.weight", (ql, d), "linear", "fp8"),
            S(f"{p}attn.q_norm.weight", (ql,), "norm", "bf16"),
            S(f"{p}attn.wq_b.weight", (h * dh, ql), "linear", "fp8"),
            S(f"{p}attn.wkv.weight", (dh, d), "linear", "fp8"),
            S(f"{p}attn.kv_norm.weight", (dh,), "norm", "bf16"),
            S(f"{p}attn.wo_a.weight", (g * ol, h * dh // g), "linear", "fp8"),
            S(f"{p}attn.wo_b.weight", (d, g * ol), "linear", "fp8"),
            S(f"{p}attn.attn_sink", (h,), "sink", "fp32")]


def dspark_head_specs(c: dict, k: int, n_mtp: int, markov_names: tuple[str, str] = ("embed", "head")) -> list:
    """The stage-owned DSpark tensors of stage k (see models.dspark_common.add_dspark_heads); the Markov head's
    two weights are named `markov_names` (V4.1: embed / head; V4-Flash-0731: markov_w1 / markov_w2)."""
    p, d, v, out = f"mtp.{k}.", c["hidden_size"], c["vocab_size"], []
    if k == 0:
        n_target = len(c.get("dspark_target_layer_ids") or [])
        out += [WeightSpec(f"{p}main_proj.weight", (d, n_target * d), "linear", "fp8"),
                WeightSpec(f"{p}main_norm.weight", (d,), "norm", "bf16")]
    if k == n_mtp - 1:
        r = c["dspark_markov_rank"]
        out += [WeightSpec(f"{p}norm.weight", (d,), "norm", "bf16"),
                WeightSpec(f"{p}markov_head.{markov_names[0]}.weight", (v, r), "embed", "bf16"),
                WeightSpec(f"{p}markov_head.{markov_names[1]}.weight", (v, r), "linear", "bf16"),
                WeightSpec(f"{p}confidence_head.proj.weight", (1, d + r), "linear", "fp32")]
    return out


def _init(spec: WeightSpec, config: dict, g: torch.Generator) -> torch.Tensor:
    shape, kind = spec.shape, spec.init
    if kind == "tid2eid":
        v, k = shape
        order = torch.rand(v, config["n_routed_experts"], generator=g).argsort(dim=1)
        return order[:, :k].to(torch.int32).contiguous()
    if kind == "hc_scale":
        return torch.rand(shape, generator=g) + 0.5
    x = torch.randn(shape, generator=g)
    if kind == "linear":
        return x * shape[-1] ** -0.5
    if kind == "head":
        return x * shape[-1] ** -0.5
    if kind == "norm":
        return 1 + 0.3 * x
    factor = {"embed": 1.0, "sink": 1.0, "hc_fn": 0.05, "hc_base": 0.5, "ape": 0.5, "bias": 0.1}[kind]
    return x * factor


def random_tensors(config: dict, seed: int, specs: list[WeightSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """(DeepSeek name, float32 tensor) for every spec (tid2eid: int32 expert ids).
    Each tensor has its own generator seeded from (seed, name), so values do not depend
    on which other tensors exist."""
    for spec in specs:
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
        yield spec.name, _init(spec, config, g)


def _quant_settings(config: dict) -> tuple[tuple[int, int], bool, str]:
    qc = config.get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size") or (128, 128))
    return block, (qc.get("scale_fmt") or "float32") == "ue8m0", config.get("expert_dtype") or "fp8"


def encode_tensor(spec: WeightSpec, t: torch.Tensor, config: dict, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """How the checkpoint stores one tensor: [(name, t)] or [(weight), (name.scale)]."""
    if spec.store == "int32":
        return [(spec.name, t.to(torch.int32))]
    if dtype == "float32":
        return [(spec.name, t.float())]
    if spec.store == "fp32":
        return [(spec.name, t.float())]
    if dtype == "bfloat16" or spec.store == "bf16":
        return [(spec.name, t.to(torch.bfloat16))]
    block, e8m0, expert_dtype = _quant_settings(config)
    if spec.store == "expert" and expert_dtype == "bf16":
        return [(spec.name, t.to(torch.bfloat16))]
    if spec.store == "expert" and expert_dtype == "fp4":
        w, s = quant_fp4(t, 32)
    elif spec.store == "fp8_rows":
        w, s = quant_fp8_blocks(t, (1, 32))
    else:
        w, s = quant_fp8_blocks(t, block)
    if not e8m0:
        s = scale_to_float(s)
    return [(spec.name, w), (spec.name[: -len(".weight")] + ".scale", s)]


class ShardWriter:
    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max(1, max_bytes)
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.total = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        save_file(self.pending, str(self.out / f".shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        weight_map = {}
        count = len(self.shards)
        for i, names in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.out / f".shard-{i}.tmp").rename(self.out / fname)
            weight_map.update({n: fname for n in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _stored_bytes(spec: WeightSpec, dtype: str) -> int:
    n = math.prod(spec.shape)
    if dtype == "float32" or spec.store in ("fp32", "int32"):
        return 4 * n
    if spec.store == "fp8_rows":
        return n + n // 32
    if dtype == "bfloat16" or spec.store == "bf16":
        return 2 * n
    return n // 2 if spec.store == "expert" else n


def open_writer(out_dir: str | Path, specs: list[WeightSpec], dtype: str,
                max_shard_bytes: int | None) -> tuple[Path, ShardWriter]:
    """Create out_dir, drop old shards/index, size shards (default: a third of the model)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    if max_shard_bytes is None:
        total = sum(_stored_bytes(s, dtype) for s in specs)
        max_shard_bytes = min(total // 3 + 1, 4 << 30)
    return out, ShardWriter(out, max_shard_bytes)
