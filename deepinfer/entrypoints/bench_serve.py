"""`deepinfer bench serve`: a load generator for any OpenAI-compatible server, with vLLM's flag and
metric names (TTFT, TPOT, ITL, E2EL; request, output and total token throughput).

Requests arrive at `--request-rate` per second (inf: all at once) with gamma-distributed gaps of
shape `--burstiness` (1: Poisson), at most `--max-concurrency` in flight. Every request streams
(bench_client.py says what is timed). A request's output length is the server's
`usage.completion_tokens` when it sends one, else the tokenizer's count of the text received, else
the number of text chunks: only tokens actually received are counted. TPOT of a request is
(E2EL - TTFT) / (output tokens - 1), for requests of more than one token.

    python -m deepinfer.entrypoints.bench_serve --port 8000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 128 --num-prompts 200 --max-concurrency 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from deepinfer.entrypoints import bench_client
from deepinfer.entrypoints.bench_datasets import (count_tokens, load_tokenizer, random_requests,
                                                  sharegpt_requests)
from deepinfer.entrypoints.args import OneLineParser, port

METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                  "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
_COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
_ERRORS_KEPT = 5  # distinct error texts in the results' `first_errors`
_TIMEOUT_S = 6 * 3600


# ---------------------------------------------------------------- flags

def _positive(kind):
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return check


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


def _commit(text: str) -> str:
    if not _COMMIT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a commit hash (7-40 lowercase hex digits, optionally -dirty)")
    return text


def _metric_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(METRICS)}")
    return names


def _percentile_list(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"{text!r}: percentiles must be in (0, 100]")
    return values


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default=None, help="server URL, e.g. http://host:8000 (default: http://HOST:PORT)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port, default=8000)
    ap.add_argument("--endpoint", default=bench_client.COMPLETIONS, choices=bench_client.ENDPOINTS)
    ap.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--dataset-name", default="random", choices=("random", "sharegpt"))
    ap.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (for --dataset-name sharegpt)")
    ap.add_argument("--sharegpt-output-len", type=_positive(int), default=None,
                    help="max_tokens for every ShareGPT request (default: the reply's length by --tokenizer)")
    ap.add_argument("--random-input-len", type=_positive(int), default=1024)
    ap.add_argument("--random-output-len", type=_positive(int), default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="lengths uniform over [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json (or its directory) to build random prompts of exact token lengths and "
                         "count tokens (default: the one in --model's directory, or in the model root the server's "
                         "/v1/models reports, when either is on this machine)")
    ap.add_argument("--num-prompts", type=_positive(int), default=1000)
    ap.add_argument("--num-warmups", type=_count, default=0, help="requests sent (and not measured) before the run")
    ap.add_argument("--request-rate", type=_positive(float), default=math.inf, help="requests/s, or inf")
    ap.add_argument("--burstiness", type=_positive(float), default=1.0,
                    help="shape of the gamma-distributed arrival gaps (1: Poisson; < 1 burstier)")
    ap.add_argument("--max-concurrency", type=_positive(int), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (a vLLM extension)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--percentile-metrics", type=_metric_list, default=["ttft", "tpot", "itl", "e2el"],
                    help="which of ttft,tpot,itl,e2el get percentiles")
    ap.add_argument("--metric-percentiles", type=_percentile_list, default=[50.0, 90.0, 99.0], help="e.g. 50,90,99")
    ap.add_argument("--save-result", action="store_true", help="write the JSON results (implied by --result-*)")
    ap.add_argument("--result-dir", default=None)
    ap.add_argument("--result-filename", default=None)
    ap.add_argument("--commit", type=_commit, default=None,
                    help="commit recorded in the results (default: git HEAD of this checkout, -dirty when "
                         "tracked files differ)")
    ap.add_argument("--request-timeout", type=_positive(float), default=_TIMEOUT_S, help="seconds per request")


def register(subparsers) -> None:
    """Add `bench serve` to a parser's subparsers; its args carry `run=main` (deepinfer's CLI calls
    args.run(args))."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server (vLLM's metric names)")
    add_arguments(serve)
    serve.set_defaults(run=main)


# ---------------------------------------------------------------- helpers

def git_commit(cwd: Path | None = None) -> str:
    """Short HEAD of the checkout holding this file, '-dirty' when tracked files differ; 'unknown'."""
    where = str(cwd or Path(__file__).resolve().parent)
    try:
        def git(*a):
            return subprocess.run(["git", *a], cwd=where, capture_output=True, text=True, timeout=30).stdout.strip()
        head = git("rev-parse", "--short", "HEAD")
        if not _COMMIT.fullmatch(head):
            return "unknown"
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of `n` requests: gaps gamma(shape=burstiness, mean=1/rate)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def _stats(values_s: list[float], percentiles: list[float], with_pct: bool) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(ms.mean()) if ms.size else 0.0, "median": float(np.median(ms)) if ms.size else 0.0,
           "std": float(ms.std()) if ms.size else 0.0}
    if with_pct:
        for p in percentiles:
            out[f"p{p:g}"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def _base_url(args) -> str:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return base[:-3] if base.endswith("/v1") else base  # the endpoint carries /v1


# ---------------------------------------------------------------- run

async def _run(args, requests, model: str, headers: dict):
    import httpx

    url = _base_url(args) + args.endpoint
    bodies = [bench_client.payload(args.endpoint, model, r, ignore_eos=args.ignore_eos,
                                   temperature=args.temperature) for r in requests]
    limit = args.max_concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    # enough connections that the pool never queues a request the benchmark has released;
    # trust_env off: a proxy between the benchmark and the server would be measured too
    limits = httpx.Limits(max_connections=limit or len(bodies) + args.num_warmups,
                          max_keepalive_connections=limit or len(bodies))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits, trust_env=False) as c:
        async def one(body):
            if sem is None:
                return await bench_client.send(c, url, headers, body)
            async with sem:
                return await bench_client.send(c, url, headers, body)

        if args.num_warmups > 0:
            await asyncio.gather(*(one(bodies[i % len(bodies)]) for i in range(args.num_warmups)))
        offsets = arrival_offsets(len(bodies), args.request_rate, args.burstiness, args.seed)
        start = time.perf_counter()

        async def paced(body, at):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await one(body)

        results = await asyncio.gather(*(paced(b, at) for b, at in zip(bodies, offsets)))
        return results, time.perf_counter() - start


async def _served_models(args, headers: dict) -> list[dict]:
    """The server's /v1/models entries (each with "id", and with "root" where the server names the
    model's directory, as vLLM does)."""
    import httpx

    async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
        r = await c.get(_base_url(args) + "/v1/models", headers=headers)
        r.raise_for_status()
        data = r.json()["data"]
        if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
            raise ValueError("entries without an id")
        return data


def _model_and_tokenizer(args, headers: dict):
    """The model name to send, and the tokenizer (with where it came from): --tokenizer, else a
    tokenizer.json in --model's directory, else one in the directory the server reports as the
    model's root (on this machine), else none."""
    import httpx

    served = None
    if not args.model or not (args.tokenizer or (Path(args.model) / "tokenizer.json").is_file()):
        try:
            served = asyncio.run(_served_models(args, headers))
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
            if not args.model:
                raise ValueError(f"--model not given and {_base_url(args)}/v1/models did not name one: {e}") from None
    if not args.model and not served:
        raise ValueError(f"--model not given and {_base_url(args)}/v1/models lists no model")
    model = args.model or served[0]["id"]
    where = args.tokenizer
    if where is None and (Path(model) / "tokenizer.json").is_file():
        where = model
    for entry in served or ():
        root = entry.get("root")
        if where is None and entry["id"] == model and isinstance(root, str) and (Path(root) / "tokenizer.json").is_file():
            where = root
    return model, (load_tokenizer(where) if where else None), where


def _requests(args, tokenizer):
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, tokenizer, args.sharegpt_output_len)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           args.seed, tokenizer)


def metrics(requests, results, duration: float, tokenizer, percentile_metrics, percentiles) -> dict:
    """vLLM's result fields from the per-request results (failed requests count no tokens)."""
    input_lens, output_lens, tpots, errors = [], [], [], []
    for req, res in zip(requests, results):
        errors.append(res.error)
        if not res.success:
            input_lens.append(0)
            output_lens.append(0)
            continue
        if res.completion_tokens is not None:
            n_out = res.completion_tokens
        elif tokenizer is not None:
            n_out = count_tokens(tokenizer, res.text)
        else:
            n_out = res.chunks
        output_lens.append(n_out)
        input_lens.append(req.prompt_len if req.prompt_len is not None else (res.prompt_tokens or 0))
        if n_out > 1:
            tpots.append((res.latency - res.ttft) / (n_out - 1))
    ok = [r for r in results if r.success]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [g for r in ok for g in r.itl],
              "e2el": [r.latency for r in ok]}
    total_in, total_out = sum(input_lens), sum(output_lens)
    out = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
           "total_token_throughput": (total_in + total_out) / duration}
    for name, values in series.items():
        for stat, v in _stats(values, percentiles, name in percentile_metrics).items():
            out[f"{stat}_{name}_ms"] = v
    distinct = list(dict.fromkeys(e for e in errors if e))
    out.update(first_errors=distinct[:_ERRORS_KEPT], input_lens=input_lens, output_lens=output_lens,
               ttfts=[r.ttft if r.success else 0.0 for r in results],
               itls=[r.itl if r.success else [] for r in results], errors=errors,
               generated_texts=[r.text for r in results])
    return out


def summary(result: dict, percentile_metrics, percentiles) -> str:
    w = 50
    rows = [(" Serving Benchmark Result ".center(w, "=")),
            f"{'Successful requests:':<40}{result['completed']:<10}",
            f"{'Failed requests:':<40}{result['failed']:<10}"]
    if result["max_concurrency"]:
        rows.append(f"{'Maximum request concurrency:':<40}{result['max_concurrency']:<10}")
    rows += [f"{'Benchmark duration (s):':<40}{result['duration']:<10.2f}",
             f"{'Total input tokens:':<40}{result['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{result['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{result['request_throughput']:<10.2f}",
             f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:<10.2f}",
             f"{'Total Token throughput (tok/s):':<40}{result['total_token_throughput']:<10.2f}"]
    for name in METRICS:
        if name not in percentile_metrics:
            continue
        short, title = _METRIC_TITLES[name]
        rows.append(title.center(w, "-"))
        rows.append(f"{f'Mean {short} (ms):':<40}{result[f'mean_{name}_ms']:<10.2f}")
        rows.append(f"{f'Median {short} (ms):':<40}{result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            rows.append(f"{f'P{p:g} {short} (ms):':<40}{result[f'p{p:g}_{name}_ms']:<10.2f}")
    rows.append("=" * w)
    for e in result["first_errors"]:
        rows.append(f"error: {e}")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark `args` describe; print the summary, write the JSON when asked, return it."""
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model, tokenizer, tokenizer_path = _model_and_tokenizer(args, headers)
    requests = _requests(args, tokenizer)
    date = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    print(f"bench serve: {len(requests)} {args.dataset_name} requests to {_base_url(args)}{args.endpoint} "
          f"(model {model}, rate {args.request_rate:g}/s, burstiness {args.burstiness:g}, max concurrency "
          f"{args.max_concurrency or 'none'}, tokenizer {tokenizer_path or 'none: token counts from the server'})",
          flush=True)
    results, duration = asyncio.run(_run(args, requests, model, headers))
    result = {"date": date, "commit": args.commit or git_commit(), "base_url": _base_url(args), "model": model,
              "endpoint": args.endpoint, "dataset": args.dataset_name, "dataset_path": args.dataset_path,
              "tokenizer": tokenizer_path, "num_prompts": len(requests),
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
              "ignore_eos": args.ignore_eos, "percentile_metrics": ",".join(args.percentile_metrics),
              "metric_percentiles": ",".join(f"{p:g}" for p in args.metric_percentiles)}
    result.update(metrics(requests, results, duration, tokenizer, args.percentile_metrics, args.metric_percentiles))
    print(summary(result, args.percentile_metrics, args.metric_percentiles))
    if args.save_result or args.result_dir or args.result_filename:
        name = args.result_filename or (f"bench-serve-{date}-{Path(model).name}-{result['commit']}"
                                        f"-rate{result['request_rate']}-conc{args.max_concurrency or 'inf'}.json")
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {path}")
        result["result_path"] = str(path)
    return result


def _standalone(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m deepinfer.entrypoints.bench_serve", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return main(args)
    except ValueError as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _standalone()
