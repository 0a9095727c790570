"""Cost of structured outputs per output token: the same requests unconstrained and under a JSON schema
(xgrammar masks filled on the host, applied on the device before sampling), at several batch sizes, in
one run. The schema cannot complete before max_tokens (an array of at least 1000 small objects), so
both modes emit exactly batch x output-len tokens and their tokens/s compare directly.

    python benchmarks/structured_outputs.py --model demo --batch 1,16,64 --output-len 128
Rows: mode (free | json), batch, output tokens, seconds (median of --reps), tokens/s, ms per step
(seconds / output-len: every request is in every step), and for json its overhead against free at
the same batch. JSON: benchmarks/results/<date>-<device>-<commit>-structured-outputs.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out  # noqa: E402

SCHEMA = {"type": "array", "minItems": 1000,
          "items": {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
                    "properties": {"name": {"type": "string", "maxLength": 12},
                                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                   "tags": {"type": "array", "maxItems": 3,
                                            "items": {"enum": ["a", "b", "c", "admin", "user"]}}}}}


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(7, min(vocab, 500), (32,), generator=g).tolist() for _ in range(n)]


def run(args) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch), seed=0,
              enforce_eager=args.enforce_eager, **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}))
    vocab = llm.model.config.vocab_size
    modes = {"free": None, "json": {"schema_type": "json", "schema": SCHEMA}}
    rows = []
    for b in args.batch:
        prompts = _prompts(b, 1, vocab)
        for mode, so in modes.items():
            sp = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, so_args=so)
            llm.generate(_prompts(b, 2, vocab), sp, use_tqdm=False)  # warm-up (graphs, grammar compile)
            runs, emitted = [], 0
            for _ in range(args.reps):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                runs.append(time.perf_counter() - t0)
                emitted = sum(len(c.token_ids) for o in outs for c in o.outputs)
                reasons = {c.finish_reason for o in outs for c in o.outputs}
                if reasons != {"length"}:
                    raise SystemExit(f"batch {b} {mode}: finish reasons {reasons}, expected length only")
            sec = statistics.median(runs)
            rows.append({"mode": mode, "batch": b, "output_tokens": emitted, "seconds": round(sec, 4),
                         "runs_s": [round(r, 4) for r in runs], "tokens_per_s": round(emitted / sec, 1),
                         "ms_per_step": round(1e3 * sec / args.output_len, 3)})
        free, js = rows[-2], rows[-1]
        js["overhead_vs_free"] = round(js["seconds"] / free["seconds"] - 1, 4)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return {"device": device, "date": datetime.date.today().isoformat(), "commit": recorded_commit(args),
            "model": args.model, "dtype": args.dtype, "schema": SCHEMA,
            "settings": {"batch": args.batch, "output_len": args.output_len, "reps": args.reps,
                         "enforce_eager": args.enforce_eager, "sampling": "temperature 1, ignore_eos"},
            "columns": {"tokens_per_s": "emitted completion tokens / LLM.generate wall time (median of reps)",
                        "overhead_vs_free": "json seconds / free seconds - 1, same batch, same run"},
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    res = run(args)
    for r in res["rows"]:
        extra = f"  overhead {100 * r['overhead_vs_free']:+.1f} %" if "overhead_vs_free" in r else ""
        print(f"{r['mode']:5s} batch {r['batch']:4d}  {r['tokens_per_s']:10.1f} tok/s  {r['ms_per_step']:8.3f} ms/step{extra}")
    out = Path(args.out) if args.out else new_results_path(Path(__file__).parent / "results" /
                                           f"{res['date']}-{res['device'].replace(' ', '-')}-{res['commit']}-structured-outputs.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
