"""Export a training run (training/train_demo.py) as a checkpoint in the released DeepSeek-V4.1 layout.

    python -m training.export --run RUN_DIR --out CKPT_DIR [--dtype fp8]

NeMo's state-dict adapters (`DeepseekV41StateDictAdapter.to_hf`, `DeepseekV41DSparkStateDictAdapter.to_hf`)
give the released tensor names in full precision; deepinfer's writer
(`deepinfer.tools.make_checkpoint_v41.weight_specs_v41` + `checkpoint_writer.encode_tensor`) stores each
the way the release does: FP8 e4m3 with E8M0 scales over 32x32 blocks for the dense projections, FP4
routed experts, FP8 Engram rows, fp32 mHC / sinks / compressor / router biases / head / confidence head,
bf16 else (--dtype bfloat16 / float32 store everything unquantised). Every tensor of the released layout
must come from the run, with its shape, and nothing may be left over. The directory gets config.json,
the sharded safetensors + index, tokenizer.json + tokenizer_config.json, and training.json (the step).

The DSpark confidences are then calibrated on held-out text (sequential temperature scaling, writes
dspark_calibration.json into CKPT_DIR):

    python -m deepinfer.eval.calibrate_dspark --model CKPT_DIR --file TOK_DIR/heldout.txt
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from deepinfer.tools.checkpoint_writer import DTYPES, encode_tensor, open_writer
from deepinfer.tools.make_checkpoint_v41 import checkpoint_config_v41, weight_specs_v41


def released_tensors(models) -> dict[str, torch.Tensor]:
    """Every tensor of the target and the draft under its released name (fp32, CPU)."""
    target = models.target.state_dict_adapter.to_hf(models.target.state_dict())
    draft = models.draft.state_dict_adapter.to_hf(models.draft.state_dict())
    out = {k: v.detach().float().cpu() for k, v in target.items()}
    # The draft's embedding and head are frozen copies of the target's; the checkpoint has one of each.
    out.update({k: v.detach().float().cpu() for k, v in draft.items() if k.startswith("mtp.")})
    return out


def write_released(out_dir: str | Path, cfg: dict, tensors: dict[str, torch.Tensor], dtype: str = "fp8",
                   max_shard_bytes: int | None = None) -> Path:
    """config.json + safetensors shards of `tensors` (released names) in the layout of `cfg`."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {DTYPES}")
    ckpt_cfg = checkpoint_config_v41(cfg, dtype)
    specs = weight_specs_v41(ckpt_cfg)
    names = {s.name for s in specs}
    missing = sorted(names - tensors.keys())
    extra = sorted(tensors.keys() - names)
    if missing or extra:
        raise ValueError(f"export: tensors missing from the run {missing[:8]} ({len(missing)}), not in the released "
                         f"layout {extra[:8]} ({len(extra)})")
    for s in specs:
        if tuple(tensors[s.name].shape) != tuple(s.shape):
            raise ValueError(f"export: {s.name} has shape {tuple(tensors[s.name].shape)}, the layout needs {s.shape}")
    out, writer = open_writer(out_dir, specs, dtype, max_shard_bytes)
    for s in specs:
        for name, value in encode_tensor(s, tensors[s.name], ckpt_cfg, dtype):
            writer.add(name, value)
    writer.finish()
    (out / "config.json").write_text(json.dumps(ckpt_cfg, indent=2) + "\n")
    return out


def export(run_dir: str | Path, out_dir: str | Path, dtype: str = "fp8") -> Path:
    from training.train_demo import load_trained

    run_dir = Path(run_dir)
    models, cfg, step = load_trained(run_dir)
    out = write_released(out_dir, cfg, released_tensors(models), dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(run_dir / name, out / name)
    (out / "training.json").write_text(json.dumps({"run": str(run_dir.resolve()), "step": step}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run directory of python -m training.train_demo")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--dtype", default="fp8", choices=DTYPES, help="fp8: the released FP8 / FP4 layout")
    args = p.parse_args(argv)
    out = export(args.run, args.out, args.dtype)
    print(json.dumps({"checkpoint": str(out)}))
    print(f"next: python -m deepinfer.eval.calibrate_dspark --model {out} --file <TOK_DIR>/heldout.txt "
          "(sequential temperature scaling of the DSpark confidences on held-out text)")
    return out


if __name__ == "__main__":
    main()
