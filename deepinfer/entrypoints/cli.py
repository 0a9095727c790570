"""deepinfer command line: `deepinfer generate --model M --prompt "..." [sampling flags]` and
`deepinfer serve --model M [--host --port --api-key ...]` (an OpenAI-compatible server; the same engine flags).

Flags are checked before the model is loaded (serve: and its address is bound before the engine process
starts); a problem the user can fix (a bad flag value, an address that cannot be bound, a model that cannot
be found, a device this build cannot use) is one line on stderr naming the flag, and exit code 2.
torch is imported only once a command runs, so `--help` is instant.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from deepinfer.entrypoints.args import USAGE_ERROR, OneLineParser, at_least_zero, port

# a message's leading field, or one of its leading "field=value, field=value" list
_FIELD = re.compile(r"(?:SamplingParams\.)?([a-z][a-z0-9_]*)\b(=[^,:\s]*)?")


def flag_message(message: str, args: argparse.Namespace) -> str:
    """A usage error's message with its leading field names ("top_p: ...", "model 'x' not found", "a=2, b=2: ...")
    as the command's flags ("--top-p: ...", "--model 'x' not found", "--a=2, --b=2: ...")."""
    dests, out, at = set(vars(args)) - {"command", "run"}, [], 0
    while (m := _FIELD.match(message, at)) and m.group(1) in dests:
        out.append("--" + m.group(1).replace("_", "-") + (m.group(2) or ""))
        at = m.end()
        if not message.startswith(", ", at):
            break
        out.append(", ")
        at += 2
    return "".join(out) + message[at:]


def _llm_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) arguments from the engine flags (_add_llm_args)."""
    kw = dict(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.max_model_len, seed=args.seed, enforce_eager=args.enforce_eager,
              batch_invariant=args.batch_invariant or None, quantization=args.quantization,
              load_format=args.load_format,
              tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
              enable_expert_parallel=args.enable_expert_parallel, enable_eplb=args.enable_eplb,
              context_parallel_size=args.context_parallel_size, eplb_config=args.eplb_config,
              speculative_config=args.speculative_config)
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_logprobs", "block_size"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    return kw


def _generate(args: argparse.Namespace) -> None:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n,
                            seq_seed=args.seq_seed, logprobs=args.logprobs)
    from deepinfer import LLM

    llm = LLM(**_llm_kwargs(args))
    try:
        for out in llm.generate(args.prompt, params, use_tqdm=False):
            for c in out.outputs:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "logprobs": _json_logprobs(c.logprobs)},
                                 ensure_ascii=False))
    finally:
        llm.close()  # a tensor-parallel LLM stops its other ranks


def _serve(args: argparse.Namespace) -> None:
    """The engine flags, then the address, are checked before the engine process starts."""
    import os

    from deepinfer.config import EngineConfig
    from deepinfer.entrypoints.openai.server import bind_socket, serve

    llm_kwargs = _llm_kwargs(args)
    EngineConfig.from_env(**llm_kwargs)
    sock = bind_socket(args.host, args.port)
    api_key = args.api_key or os.environ.get("DEEPINFER_API_KEY") or None
    sys.exit(serve(llm_kwargs, sock, args.served_model_name or args.model or "default", api_key=api_key,
                   max_queue_len=args.max_queue_len, default_thinking=False if args.no_thinking else None,
                   shutdown_timeout=args.shutdown_timeout, log_level=args.log_level))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _json_logprobs(lps):
    return None if lps is None else [{str(t): v for t, v in d.items()} for d in lps]


def _add_llm_args(g: argparse.ArgumentParser) -> None:
    """The engine flags `generate` and `serve` share (LLM's arguments)."""
    g.add_argument("--model", default=None,
                   help="local dir, hub id, or 'demo' (default: DEEPINFER_HF_MODEL_DIR, else the V4.1-Flash hub id)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda where available)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "bfloat16", "float32"])
    g.add_argument("--quantization", default=None, choices=["fp8", "none"],
                   help="fp8: keep the checkpoint's FP8/FP4 weights; none: dequantise to --dtype "
                        "(default: keep them on CUDA, dequantise on the CPU)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights from config.json alone, no shard read (benchmarks, memory sizing)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--enable-expert-parallel", action="store_true", help="split the routed experts over the ranks")
    g.add_argument("--enable-eplb", action="store_true", help="expert-parallel load balancing")
    g.add_argument("--eplb-config", type=_json_object, default=None,
                   help='vLLM\'s EPLB settings as JSON, e.g. \'{"step_interval": 3000, "window_size": 1000, '
                        '"num_redundant_experts": 8}\'')
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='vLLM\'s speculative decoding settings as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None, help="requests in a step at most (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens in a step at most (default 8192)")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="cache bytes (default: what the device has)")
    g.add_argument("--max-logprobs", type=int, default=None, help="the most logprobs a request may ask for (20)")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--batch-invariant", action="store_true", help="same logits whatever the batch")


def _eval(args: argparse.Namespace) -> None:
    """`deepinfer eval TOOL ARGS`: deepinfer.eval.TOOL's main(ARGS), its exit status ours."""
    import importlib

    sys.exit(importlib.import_module(f"deepinfer.eval.{args.tool}").main(args.args))


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="deepinfer")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for one or more prompts (one JSON line each)")
    _add_llm_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--seq-seed", type=int, default=None)
    g.add_argument("--logprobs", type=int, default=None)
    g.set_defaults(run=_generate)

    s = sub.add_parser("serve", help="serve the model over HTTP (OpenAI / Anthropic-compatible endpoints)")
    _add_llm_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=port, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (or x-api-key); default DEEPINFER_API_KEY, else none")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--max-queue-len", type=at_least_zero(int), default=1024,
                   help="requests that may wait beyond --max-num-seqs; more are refused with 429 + Retry-After")
    s.add_argument("--no-thinking", action="store_true",
                   help="chat requests that do not ask for a thinking mode get none (default: thinking on, as in "
                        "DeepSeek's API; off for the demo models, which never learnt to think)")
    s.add_argument("--shutdown-timeout", type=at_least_zero(float), default=30.0,
                   help="seconds SIGTERM waits for requests in flight to finish")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(run=_serve)

    from deepinfer.eval import TOOLS

    e = sub.add_parser("eval", help="model-quality evaluations (deepinfer.eval: one JSON object each)")
    e.add_argument("tool", choices=TOOLS, help="the evaluation; `deepinfer eval TOOL --help` lists its flags")
    e.add_argument("args", nargs=argparse.REMAINDER, help="the tool's flags")
    e.set_defaults(run=_eval)

    # subcommands of other modules: register(sub) adds a parser with set_defaults(run=callable(args))
    from deepinfer.entrypoints.bench_serve import register as register_bench

    register_bench(sub)  # `deepinfer bench serve`
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: the loader's ModelNotFoundError
        print(f"deepinfer: error: {flag_message(str(e), args)}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


if __name__ == "__main__":
    main()
