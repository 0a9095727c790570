"""Offline throughput: deepinfer LLM.generate vs transformers generate, same weights, same run.

A fixed synthetic workload: N random prompts of exactly --input-len tokens, each generating
exactly --output-len tokens (ignore_eos / min_new_tokens), greedy. Reports requests/s and
output tokens/s, counting only tokens actually emitted.

    python benchmarks/offline_throughput.py --preset demo --device cpu

`--load-format dummy`: the preset's config.json alone (make_checkpoint's weights=False, DeepSeek's layout,
FP8 / FP4 formats) served with random weights (LLM's load_format="dummy"): a released model at its full
size without writing or reading its ~160 GB; transformers is skipped (it has no such weights), and
`--concurrency` runs one timed generate per listed request count in the same LLM (the row's requests =
its concurrency, all submitted at once, max_num_seqs the largest):

    python benchmarks/offline_throughput.py --preset flash --load-format dummy --dtype bfloat16 \
        --data-parallel-size 4 --enable-expert-parallel --concurrency 4,256,1024 --input-len 1024 --output-len 128
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


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for _ in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_deepinfer(ckpt: Path, prompts, out_len: int, args, batch_invariant: bool = False,
                  concurrency: list[int] | None = None) -> list[dict]:
    """One row per concurrency (default: all prompts at once): a timed LLM.generate of that many prompts."""
    parallel = dict(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                    enable_expert_parallel=args.enable_expert_parallel)
    sizes = concurrency or [len(prompts)]
    llm = LLM(str(ckpt), device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              max_num_seqs=max(max(sizes), 1), skip_tokenizer_init=True, batch_invariant=batch_invariant,
              load_format=args.load_format, **parallel)
    rows = []
    try:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        for n in sizes:
            _sync(args.device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:n], params, use_tqdm=False)
            _sync(args.device)
            elapsed = time.perf_counter() - t0
            row = _row("deepinfer (batch_invariant)" if batch_invariant else "deepinfer", len(outs),
                       sum(len(o.outputs[0].token_ids) for o in outs), elapsed)
            rows.append({**row, "parallel": parallel, "concurrency": n})
    finally:
        llm.close()
    return rows


def run_transformers(ckpt: Path, prompts, out_len: int, args) -> dict:
    import transformers

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    ids = torch.tensor(prompts, device=args.device)
    kw = dict(do_sample=False, max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=2)
    with torch.inference_mode():
        model.generate(ids[:2], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        _sync(args.device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(args.device)
    elapsed = time.perf_counter() - t0
    return _row("transformers", len(prompts), int((out.shape[1] - ids.shape[1]) * ids.shape[0]), elapsed)


def _row(engine: str, n: int, tokens: int, elapsed: float) -> dict:
    return {"engine": engine, "requests": n, "output_tokens": tokens, "seconds": round(elapsed, 3),
            "requests_per_s": round(n / elapsed, 3), "output_tokens_per_s": round(tokens / elapsed, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: the preset's config.json only, random weights (LLM's load_format)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma list of request counts, one timed generate each (default: --num-prompts)")
    ap.add_argument("--batch-invariant-cost", action="store_true",
                    help="also run deepinfer with batch_invariant=True and report the throughput it costs")
    add_commit_arg(ap)
    ap.add_argument("--out", default=None, help="JSON results path (default: benchmarks/results/<date>-<device>-offline.json)")
    args = ap.parse_args()
    refuse_existing_out(args)

    dummy = args.load_format == "dummy"
    if dummy:
        args.skip_transformers = True
    vocab = PRESETS[args.preset].get("vocab_size") or PRESETS[args.preset]["text_config"]["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        if dummy:  # DeepSeek's layout in its shipped formats, config.json and tokenizer only
            ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], dtype="fp8", weights=False)
        else:  # transformers' layout + config keys: both engines load the same directory
            ckpt = write_checkpoint(Path(tmp) / "ckpt", PRESETS[args.preset], seed=0, dtype=args.dtype, layout="hf")
        n = max(args.concurrency or [args.num_prompts])
        prompts = _prompts(n, args.input_len, vocab, seed=1)
        rows = run_deepinfer(ckpt, prompts, args.output_len, args, concurrency=args.concurrency)
        if args.batch_invariant_cost:
            rows += run_deepinfer(ckpt, prompts, args.output_len, args, batch_invariant=True)
        if not args.skip_transformers:
            rows.append(run_transformers(ckpt, prompts, args.output_len, args))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    gpus = args.tensor_parallel_size * args.data_parallel_size if args.device.startswith("cuda") else 0
    for r in rows:
        if gpus and r["engine"].startswith("deepinfer"):
            r["output_tokens_per_s_per_gpu"] = round(r["output_tokens_per_s"] / gpus, 1)
    result = {
        "device": device, "num_gpus": gpus, "load_format": args.load_format,
        "date": str(date.today()), "commit": recorded_commit(args), "preset": args.preset,
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "rows": rows,
        "command": "python benchmarks/offline_throughput.py " + " ".join(
            f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if v not in (None, False) and k not in ("out", "commit") and v is not True)
                   + "".join(f" --{k.replace('_', '-')}" for k, v in vars(args).items() if v is True),
    }
    by = {r["engine"]: r["output_tokens_per_s"] for r in rows}  # the last row of each engine
    if "transformers" in by:
        result["ratio_output_tokens_per_s"] = round(by["deepinfer"] / by["transformers"], 2)
    if "deepinfer (batch_invariant)" in by:
        result["batch_invariant_cost"] = round(1 - by["deepinfer (batch_invariant)"] / by["deepinfer"], 3)
    out = new_results_path(args.out or Path(__file__).parent / "results" /
                           f"{date.today()}-{device.replace(' ', '-')}-offline.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'engine':<30}{'requests':>10}{'req/s':>10}{'out tok/s':>12}{'seconds':>10}")
    for r in rows:
        print(f"{r['engine']:<30}{r['requests']:>10}{r['requests_per_s']:>10}{r['output_tokens_per_s']:>12}"
              f"{r['seconds']:>10}")
    if "ratio_output_tokens_per_s" in result:
        print(f"deepinfer / transformers output tok/s: {result['ratio_output_tokens_per_s']}x")
    if "batch_invariant_cost" in result:
        print(f"batch_invariant costs {100 * result['batch_invariant_cost']:.1f} % of output tok/s")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
