"""What vLLM's logits processing costs a decode step (issue 40's target: penalties and logit bias under 5 % of the
decode step at batch 64): output tokens/s of LLM.generate with the same prompts and lengths, plain greedy against
rows that carry the penalties (presence, frequency, repetition), a logit bias of 16 tokens, min_tokens and a bad
word of two tokens, one process, one LLM.

Every request generates exactly --output-len tokens (ignore_eos; min_tokens below it); greedy. The processed rows
still decode greedily, so both rows run the same number of steps; tokens differ (that is the point of the fields),
and only emitted tokens are counted. One warm-up generate of each row's parameters, then --reps timed generates, the
median reported; `cost` = 1 - processed tok/s / plain tok/s.

    python benchmarks/sampling_cost.py --out results.json            # the V4.1 demo, 64 x (128 in, 128 out), GPU
    python benchmarks/sampling_cost.py --smoke                       # tiny41 on the CPU, a temporary file
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out
from offline_throughput import _prompts, _sync


def rows(output_len: int) -> dict:
    from deepinfer import SamplingParams

    g = dict(temperature=0, max_tokens=output_len, ignore_eos=True)
    return {
        "plain": SamplingParams(**g),
        "penalties": SamplingParams(**g, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
        "logit_bias": SamplingParams(**g, logit_bias={t: 1.0 for t in range(100, 116)}),
        "all": SamplingParams(**g, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                              logit_bias={t: 1.0 for t in range(100, 116)}, min_tokens=output_len // 2,
                              bad_words_token_ids=[[200, 201]]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="checkpoint directory or 'demo' / 'demo-random' (default demo)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny41 on the CPU, 4 x (16 in, 8 out), one rep")
    ap.add_argument("--out",
                    help="results JSON (default benchmarks/results/<date>-<device>-<commit>-sampling-cost.json)")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    from deepinfer import LLM

    tmp = tempfile.TemporaryDirectory()
    kw = {}
    if args.smoke:
        from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

        args.device, args.num_prompts, args.input_len, args.output_len, args.reps = "cpu", 4, 16, 8, 1
        path, name = write_checkpoint(Path(tmp.name) / "tiny41", PRESETS["tiny41"], seed=5, dtype="fp8"), "tiny41"
        kw = dict(dtype="float32", kv_cache_memory=32 << 20)
    else:
        from deepinfer.tools.demo import resolve_demo

        path, name = resolve_demo(args.model) or args.model, args.model
    llm = LLM(str(path), device=args.device, max_num_seqs=args.num_prompts, **kw)
    vocab = llm.model.config.vocab_size
    prompts = _prompts(args.num_prompts, args.input_len, vocab, seed=1)
    results = []
    for label, params in rows(args.output_len).items():
        llm.generate(_prompts(args.num_prompts, args.input_len, vocab, seed=2), params, use_tqdm=False)  # warm-up
        runs, tokens = [], 0
        for _ in range(args.reps):
            _sync(args.device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            _sync(args.device)
            runs.append(time.perf_counter() - t0)
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            assert tokens == args.num_prompts * args.output_len, tokens
        s = statistics.median(runs)
        results.append({"row": label, "output_tokens": tokens, "seconds": round(s, 4),
                        "runs_s": [round(t, 4) for t in runs], "output_tokens_per_s": round(tokens / s, 1)})
        print(f"{label:<12} {tokens / s:>10.1f} tok/s", flush=True)
    base = results[0]["output_tokens_per_s"]
    for r in results:
        r["cost"] = round(1 - r["output_tokens_per_s"] / base, 4)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    commit = recorded_commit(args)
    doc = {"device": device, "date": str(date.today()), "commit": commit, "model": name, "smoke": args.smoke,
           "settings": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "reps")},
           "rows_params": {k: repr(v) for k, v in rows(args.output_len).items()},
           "columns": {"output_tokens_per_s": "emitted tokens / LLM.generate wall time (median of reps)",
                       "cost": "1 - this row's tok/s / plain's"},
           "rows": results}
    if args.out:
        out = Path(args.out)
    else:
        out_dir = Path(tempfile.mkdtemp(prefix="sampling-cost-")) if args.smoke else Path(__file__).parent / "results"
        out = new_results_path(out_dir / f"{date.today()}-{device.replace(' ', '-')}-{commit}-sampling-cost.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
