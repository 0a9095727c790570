"""The "1000 completions" check (Thinking Machines' batch-invariance test): one prompt submitted N
times amid varied neighbours, token budgets and batch sizes; count the distinct completions (tokens
and logprob bits). With batch_invariant the count must be 1. The run without it is the control: it must
give more than 1, or the workload did not vary what batch invariance guards against and the check shows
nothing. The last line is the verdict (exit status 1 when the check fails).

    python benchmarks/identical_completions.py --device cpu --num 200
    python benchmarks/identical_completions.py --device cuda --dtype bfloat16 --num 1000
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out

from deepinfer import LLM, SamplingParams
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint


def run(ckpt: Path, args, invariant: bool, num: int) -> dict:
    preset = PRESETS[args.preset]
    vocab = preset.get("text_config", preset)["vocab_size"]  # V4.1 presets nest the text model
    rng = random.Random(0)
    prompt = [0] + [rng.randrange(3, vocab) for _ in range(args.prompt_len - 1)]
    target = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, logprobs=1,
                            seq_seed=None if args.temperature == 0 else 42)
    seen: dict[tuple, int] = {}
    done, t0 = 0, time.perf_counter()
    budgets = [args.budget, 16, 64]
    engines = {b: LLM(str(ckpt), device=args.device, dtype=args.dtype, kv_cache_dtype=args.dtype,
                      max_num_batched_tokens=b, skip_tokenizer_init=True, batch_invariant=invariant,
                      kv_cache_memory=1 << 30)
               for b in budgets}
    while done < num:
        copies = min(num - done, rng.randint(1, 8))
        noise = [[0] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 3 * args.prompt_len))]
                 for _ in range(rng.randint(0, 12))]
        batch = [prompt] * copies + noise
        rng.shuffle(batch)
        params = [target if p is prompt else SamplingParams(temperature=rng.choice([0, 0.8]), ignore_eos=True,
                                                            max_tokens=rng.randint(1, 2 * args.output_len))
                  for p in batch]
        outs = engines[rng.choice(budgets)].generate(batch, params, use_tqdm=False)
        for p, o in zip(batch, outs):
            if p is prompt:
                c = o.outputs[0]
                key = (tuple(c.token_ids), tuple(tuple(sorted(lp.items())) for lp in c.logprobs))
                seen[key] = seen.get(key, 0) + 1
                done += 1
                if done % 100 == 0:
                    print(f"batch_invariant={invariant}: {done} completions, {len(seen)} unique, "
                          f"{time.perf_counter() - t0:.0f} s", flush=True)
    del engines
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"batch_invariant": invariant, "completions": done, "unique": len(seen),
            "largest_group": max(seen.values()), "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling (seq_seed=42)")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens of one of the engines")
    ap.add_argument("--modes", choices=("both", "on", "off"), default="both",
                    help="batch-invariant mode on, off (the control), or both")
    ap.add_argument("--control-num", type=int, default=None, help="completions of the control (default: --num)")
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], seed=0, dtype=args.dtype)
        rows = [run(ckpt, args, inv, args.num if inv else args.control_num or args.num)
                for inv in {"both": (False, True), "on": (True,), "off": (False,)}[args.modes]]
    for r in rows:
        print(json.dumps(r))
    failed = [f"batch_invariant={r['batch_invariant']}: {r['unique']} distinct of {r['completions']}"
              for r in rows if (r["unique"] == 1) != r["batch_invariant"]]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"device": device, "date": str(date.today()), "commit": recorded_commit(args),
              "workload": {k: v for k, v in vars(args).items() if k not in ("out", "commit")}, "rows": rows}
    name = f"{date.today()}-{device.replace(' ', '-')}-identical-completions.json"
    out = new_results_path(args.out or Path(__file__).parent / "results" / name)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    print(f"FAIL: {'; '.join(failed)} (switch on must give 1, the control off more than 1)" if failed else
          "PASS: " + "; ".join(f"batch_invariant={r['batch_invariant']}: {r['unique']} distinct of "
                               f"{r['completions']}" for r in rows))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
