"""GPU idle time between engine steps with async scheduling on and off (same run, same workload).

The engine (LLM.generate) runs N random prompts to a fixed output length on a V4 checkpoint in
bf16 (decode steps as CUDA graphs). Per setting: output tokens/s (no profiler), then one profiled
run: GPU busy time = the sum of kernel durations (one stream, kernels do not overlap), idle =
wall - busy, reported per engine step.

    python benchmarks/async_overlap.py --preset demo --num-prompts 32 --output-len 64
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out

from deepinfer import LLM, SamplingParams
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint


def measure(ckpt: Path, prompts, args, on: bool) -> dict:
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", kv_cache_dtype="bfloat16", skip_tokenizer_init=True,
              max_num_seqs=len(prompts), async_scheduling=on)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: captures every graph bucket used below
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        pwall = time.perf_counter() - t1
    busy = sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return {"async_scheduling": on, "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "step_ms": round(1e3 * wall / len(steps), 3), "profiled_steps": len(steps),
            "gpu_busy_ms_per_step": round(1e3 * busy / len(steps), 3),
            "gpu_idle_ms_per_step": round(1e3 * (pwall - busy) / len(steps), 3),
            "gpu_idle_fraction": round(1 - busy / pwall, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], seed=0, dtype="bfloat16")
        g = torch.Generator().manual_seed(0)
        vocab = PRESETS[args.preset]["vocab_size"]
        prompts = [[0] + torch.randint(3, vocab, (args.input_len - 1,), generator=g).tolist()
                   for _ in range(args.num_prompts)]
        rows = [measure(ckpt, prompts, args, on) for on in (False, True)]
    for r in rows:
        print(json.dumps(r))
    result = {"device": torch.cuda.get_device_name(), "date": str(date.today()), "commit": recorded_commit(args),
              "workload": {"preset": args.preset, "num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "dtype": "bfloat16"}, "rows": rows}
    out = new_results_path(args.out or Path(__file__).parent / "results" / f"{date.today()}-async-overlap.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
