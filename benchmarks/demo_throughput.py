"""End to end, V4.1 against V4: output tokens/s of LLM.generate on the V4 demo model and on the
V4.1 demo model in one run, and their ratio (V4.1 / V4).

The checkpoints: V4.1's is the one `LLM(model="demo-random")` serves (deepinfer/tools/demo.py: the
demo41 preset, the trained demo's widths with random weights: 10 layers, hidden 256, every CSA2 role,
Engram, DSpark stages, in the released layout: FP8 32x32 blocks, FP4 experts, FP8 Engram rows, its
tokenizer); V4's is the `demo` preset (8 layers, hidden 256) in DeepSeek's layout (FP8 64x64 blocks).
Both are written into a temporary directory and loaded through the real loader. Every LLM setting is its default (bf16, kv_cache_dtype "auto" = the
reference cache formats, async scheduling on, CUDA graphs on, tokenizer loaded) except max_num_seqs,
the number of requests. The engine decides what it runs for each model; each row records whether it
used async scheduling and CUDA graphs.

Workload: N random prompts of exactly --input-len tokens, each generating exactly --output-len
tokens (ignore_eos), greedy; one warm-up generate of the same shape (other prompts), then --reps
timed generates of the same prompts, the median reported. Output tokens/s counts only the tokens in
the outputs (a look-ahead token that async scheduling drops is not counted), and every request must
finish by length with exactly --output-len tokens. Each model runs in its own process, so each LLM
sizes its cache from the memory the other did not hold.

    python benchmarks/demo_throughput.py --out results.json   # 64 x (256 in, 128 out) on the GPU
    python benchmarks/demo_throughput.py --smoke              # tiny models on the CPU, a temporary file
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out
from offline_throughput import _prompts, _sync

MODELS = ("v4", "v41", "v41-host")
NAMES = {"v4": "V4 demo", "v41": "V4.1 demo", "v41-host": "V4.1 demo, engram_device=cpu"}
# the cost of host-resident Engram tables (host hashing, rows staged through pinned memory, synchronous)
ENGRAM_DEVICE = {"v41-host": "cpu"}


def write_demo(model: str, preset: str, root: Path) -> Path:
    """The model's demo checkpoint under `root` (V4.1: demo.py's own writer for the demo41 preset)."""
    from deepinfer.tools.demo import random_demo_checkpoint
    from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

    if model.startswith("v41") and preset == "demo41":
        return random_demo_checkpoint(root)
    return write_checkpoint(root / f"{preset}-{model}", PRESETS[preset], seed=0, dtype="fp8")


def measure(model: str, preset: str, ckpt: Path, args) -> dict:
    """One model's row: LLM with its defaults, a warm-up generate, then --reps timed ones."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(ckpt), device=args.device, max_num_seqs=args.num_prompts, engram_device=ENGRAM_DEVICE.get(model))
    vocab = llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(_prompts(args.num_prompts, args.input_len, vocab, seed=2), params, use_tqdm=False)  # warm-up
    prompts = _prompts(args.num_prompts, args.input_len, vocab, seed=1)
    runs, tokens = [], None
    for _ in range(args.reps):
        _sync(args.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(args.device)
        runs.append(time.perf_counter() - t0)
        tokens = emitted_tokens(outs, args.output_len)
    seconds = statistics.median(runs)
    return {"model": NAMES[model], "preset": preset, "requests": len(prompts), "output_tokens": tokens,
            "seconds": round(seconds, 3), "runs_s": [round(t, 3) for t in runs],
            "requests_per_s": round(len(prompts) / seconds, 3), "output_tokens_per_s": round(tokens / seconds, 1),
            "async_scheduling": llm.engine.core.async_scheduling, "cuda_graphs": llm.engine.core.runner.graphs is not None}


def emitted_tokens(outs, output_len: int) -> int:
    """Tokens in the outputs; every completion must have stopped by length at exactly output_len."""
    wrong = [(o.request_id, c.finish_reason, len(c.token_ids)) for o in outs for c in o.outputs
             if c.finish_reason != "length" or len(c.token_ids) != output_len]
    if wrong:
        raise RuntimeError(f"{len(wrong)} completions did not emit exactly {output_len} tokens by length, "
                           f"first {wrong[0]}")
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


def run_model_process(model: str, preset: str, ckpt: Path, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--model-only", model, "--preset-only", preset, "--ckpt", str(ckpt),
               "--row-out", f.name, "--device", args.device, "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--reps", str(args.reps)]
        res = subprocess.run(cmd)
        text = Path(f.name).read_text()
    if res.returncode != 0 or not text:
        return {"model": NAMES[model], "preset": preset, "error": f"process exited with {res.returncode} "
                                                                  "(traceback above)"}
    return json.loads(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-only", choices=MODELS, help=argparse.SUPPRESS)   # child process of run_model_process
    ap.add_argument("--preset-only", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    ap.add_argument("--v4-preset", default="demo")
    ap.add_argument("--v41-preset", default="demo41")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS), help=f"which rows, of {','.join(MODELS)}")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny models (tiny, tiny41) on the CPU, 4 x (16 in, 4 out), one rep: checks the script")
    add_commit_arg(ap)
    ap.add_argument("--out", default=None,
                    help="JSON results path (default: benchmarks/results/<date>-<device>-demo-throughput.json)")
    args = ap.parse_args()
    refuse_existing_out(args)
    if args.model_only:
        row = measure(args.model_only, args.preset_only, Path(args.ckpt), args)
        Path(args.row_out).write_text(json.dumps(row))
        return
    if args.smoke:
        args.v4_preset, args.v41_preset, args.device = "tiny", "tiny41", "cpu"
        args.num_prompts, args.input_len, args.output_len, args.reps = 4, 16, 4, 1
    presets = {"v4": args.v4_preset, "v41": args.v41_preset, "v41-host": args.v41_preset}
    chosen = args.models.split(",")
    if not chosen or any(m not in MODELS for m in chosen):
        raise SystemExit(f"--models: {args.models!r}: choose from {','.join(MODELS)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_model_process(m, presets[m], write_demo(m, presets[m], Path(tmp)), args) for m in chosen]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"device": device, "date": str(date.today()), "commit": recorded_commit(args),
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "reps": args.reps, "sampling": "greedy, ignore_eos",
                           "llm": "defaults: dtype bfloat16, kv_cache_dtype auto, async_scheduling on, "
                                  "CUDA graphs on (enforce_eager False); max_num_seqs = num_prompts"},
              "rows": rows}
    by = {r["model"]: r.get("output_tokens_per_s") for r in rows}
    by = {NAMES[m]: by.get(NAMES[m]) for m in MODELS}
    if by[NAMES["v4"]] and by[NAMES["v41"]]:
        result["ratio_v41_over_v4"] = round(by[NAMES["v41"]] / by[NAMES["v4"]], 3)
    if by[NAMES["v41"]] and by[NAMES["v41-host"]]:
        result["ratio_engram_host_over_device"] = round(by[NAMES["v41-host"]] / by[NAMES["v41"]], 3)
    if args.out:
        out = Path(args.out)
    elif args.smoke:
        out = Path(tempfile.mkdtemp(prefix="demo-throughput-smoke-")) / "demo-throughput.json"
    else:
        out = new_results_path(Path(__file__).parent / "results" /
                               f"{date.today()}-{device.replace(' ', '-')}-demo-throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'model':<30}{'out tok/s':>12}{'seconds':>10}{'async':>8}{'graphs':>8}")
    for r in rows:
        error = f"  {r['error']}" if "error" in r else ""
        print(f"{r['model']:<30}{str(r.get('output_tokens_per_s')):>12}{str(r.get('seconds')):>10}"
              f"{str(r.get('async_scheduling')):>8}{str(r.get('cuda_graphs')):>8}{error}")
    if "ratio_v41_over_v4" in result:
        print(f"V4.1 / V4 output tok/s: {result['ratio_v41_over_v4']}x")
    print(f"wrote {out}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
