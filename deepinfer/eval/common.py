"""What the generating evaluations share: the engine's options, and prompts cut from a text file (or given
as strings) so that every evaluation reads the same prompts from the same arguments.

Prompts from `--file F`: F is tokenized whole without BOS and cut into consecutive, non-overlapping pieces
of `--prompt-len` tokens (a shorter tail is dropped), the first `--skip-prompts` of them dropped (e.g. the
pieces `calibrate_dspark` fitted its temperatures on) and the next `--max-prompts` kept; each prompt
is BOS (where the model has one) and its piece. `--prompts S [S ...]`: each string encoded as one prompt,
BOS first.

Every tool's `main(argv)` returns its exit status: 0 with its JSON object printed as one line on stdout;
USAGE_ERROR with one line on stderr naming the flag or file for a bad argument (a missing or unreadable file,
a value out of range, a model that cannot be found or does not fit the tool), never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

USAGE_ERROR = 2  # argparse's exit status for a bad command line


class UsageError(ValueError):
    """A bad command line (Parser raises it instead of printing the usage and exiting)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def at_least(least: int) -> Callable[[str], int]:
    """argparse type: an integer >= least."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need an integer >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"need an integer >= {least}, got {value}")
        return value
    return parse


def text_file(text: str) -> Path:
    """argparse type: a path that is a file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'a directory' if path.is_dir() else 'no such file'}")
    return path


def read_text(path: Path, flag: str = "--file") -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror}") from None


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="checkpoint directory, hub id, or 'demo'")
    ap.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    ap.add_argument("--dtype", default=None, help="activations (default: float32 on the CPU, else bfloat16)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-model-len", type=at_least(2), default=None)
    ap.add_argument("--kv-cache-memory", type=at_least(1), default=None, help="cache bytes (default: the engine's)")


def add_prompt_args(ap: argparse.ArgumentParser, prompt_len: int = 64, max_prompts: int = 32) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", type=text_file, help="UTF-8 text file the prompts are cut from")
    src.add_argument("--prompts", nargs="+", help="prompt strings (instead of --file)")
    ap.add_argument("--prompt-len", type=at_least(1), default=prompt_len, help="tokens per prompt cut from --file")
    ap.add_argument("--max-prompts", type=at_least(1), default=max_prompts, help="prompts cut from --file, at most")
    ap.add_argument("--skip-prompts", type=at_least(0), default=0,
                    help="pieces of --file dropped before the first prompt")


def engine(args: argparse.Namespace, **options):
    """LLM from the engine options (`options`: any other LLM keyword, e.g. num_speculative_tokens)."""
    import torch

    from deepinfer import LLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    try:
        return LLM(args.model, device=device, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
                   max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, **options)
    except FileNotFoundError as e:  # (ModelNotFoundError included) no such model, or a file of it missing
        raise UsageError(f"--model: {e}") from None


def cut_prompts(tokens: list[int], prompt_len: int, max_prompts: int, bos: int | None,
                skip: int = 0) -> list[list[int]]:
    """Consecutive non-overlapping pieces of `prompt_len` tokens (a shorter tail dropped), the first `skip`
    dropped and the next `max_prompts` kept, each after BOS (None: none)."""
    if skip < 0:
        raise ValueError(f"--skip-prompts must be >= 0, got {skip}")
    prefix = [] if bos is None else [bos]
    starts = range(skip * prompt_len, len(tokens) - prompt_len + 1, prompt_len)
    return [prefix + tokens[i:i + prompt_len] for i in starts][:max_prompts]


def source(args: argparse.Namespace) -> dict:
    """Where the prompts came from, for the result."""
    return {"file": str(args.file)} if args.file is not None else {"prompts_given": len(args.prompts)}


def run_main(prog: str, run: Callable[[list[str] | None], dict], argv: list[str] | None) -> int:
    """A tool's main (the module doc): `run(argv)` returns the JSON object. A ValueError (UsageError included)
    is a bad argument; any other exception is a fault of the tool and keeps its traceback."""
    try:
        result = run(argv)
    except SystemExit as e:  # --help (Parser raises UsageError for every error)
        return e.code if isinstance(e.code, int) else 0
    except ValueError as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return USAGE_ERROR
    print(json.dumps(result))
    return 0


def prompts(llm, args: argparse.Namespace) -> list[list[int]]:
    """The prompts `add_prompt_args` describes, as token ids."""
    if llm.detokenizer is None:
        raise ValueError("--model: the checkpoint has no tokenizer to read prompts with")
    bos = llm.model.config.bos_token_id
    if args.prompts is not None:
        return [llm.detokenizer.encode(p, bos) for p in args.prompts]
    tokens = llm.detokenizer.encode(read_text(args.file), None)
    out = cut_prompts(tokens, args.prompt_len, args.max_prompts, bos, args.skip_prompts)
    if not out:
        raise ValueError(f"--file: {len(tokens)} tokens, fewer than (--skip-prompts={args.skip_prompts} + 1) x "
                         f"--prompt-len={args.prompt_len}")
    return out
