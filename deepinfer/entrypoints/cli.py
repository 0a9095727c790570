"""deepinfer command line: `deepinfer generate --model M --prompt "..." [sampling flags]` and
`deepinfer serve --model M [--host --port --api-key ...]` (an OpenAI-compatible server; the same engine flags,
one per option of EngineConfig: deepinfer/config.py declares them).

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

from deepinfer.config import add_engine_args, engine_kwargs
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


def _worker_node(args: argparse.Namespace) -> bool:
    """Whether this is node node_rank > 0 of a multi-node engine, run here until node 0 ends it."""
    kwargs = engine_kwargs(args)
    if not kwargs.get("node_rank"):
        return False
    from deepinfer.llm import run_worker_node

    run_worker_node(**kwargs)
    return True


def _generate(args: argparse.Namespace) -> None:
    if _worker_node(args):
        return
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n,
                            seq_seed=args.seq_seed, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            logit_bias=args.logit_bias, min_tokens=args.min_tokens, bad_words=args.bad_words,
                            allowed_token_ids=args.allowed_token_ids)
    from deepinfer import LLM

    llm = LLM(**engine_kwargs(args))
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

    if _worker_node(args):
        return
    llm_kwargs = engine_kwargs(args)
    EngineConfig.from_env(**llm_kwargs)  # the values, as LLM checks them (the device's default aside: torch's)
    sock = bind_socket(args.host, args.port)
    api_key = args.api_key or os.environ.get("DEEPINFER_API_KEY") or None
    sys.exit(serve(llm_kwargs, sock, args.served_model_name or args.model or "default", api_key=api_key,
                   max_queue_len=args.max_queue_len, default_thinking=False if args.no_thinking else None,
                   shutdown_timeout=args.shutdown_timeout, log_level=args.log_level))


def _json_logprobs(lps):
    return None if lps is None else [{str(t): v for t, v in d.items()} for d in lps]


def _eval(args: argparse.Namespace) -> None:
    """`deepinfer eval TOOL ARGS`: deepinfer.eval.TOOL's main(ARGS), its exit status ours."""
    import importlib

    sys.exit(importlib.import_module(f"deepinfer.eval.{args.tool}").main(args.args))


def _logit_bias(text: str) -> dict[int, float]:
    try:
        return {int(k): float(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias: {text!r} is not ID=BIAS[,ID=BIAS...]") from None


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--allowed-token-ids: {text!r} is not ID[,ID...]") from None


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="deepinfer")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for one or more prompts (one JSON line each)")
    add_engine_args(g.add_argument_group("engine", "LLM's options (deepinfer/config.py EngineConfig)"))
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
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--logit-bias", type=_logit_bias, default=None, metavar="ID=BIAS[,ID=BIAS...]")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--bad-words", action="append", default=None, metavar="WORD", help="repeat for several words")
    g.add_argument("--allowed-token-ids", type=_ids, default=None, metavar="ID[,ID...]")
    g.set_defaults(run=_generate)

    s = sub.add_parser("serve", help="serve the model over HTTP (OpenAI / Anthropic-compatible endpoints)")
    add_engine_args(s.add_argument_group("engine", "LLM's options (deepinfer/config.py EngineConfig)"))
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
