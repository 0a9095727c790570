"""What the generating evaluations share: the engine's options, and prompts cut from a text file (or given
as strings) so that every evaluation reads the same prompts from the same arguments.

Prompts from `--file F`: F is tokenized whole without BOS and cut into consecutive, non-overlapping pieces
of `--prompt-len` tokens (a shorter tail is dropped), the first `--skip-prompts` of them dropped (e.g. the
pieces `calibrate_dspark` fitted its temperatures on) and the next `--max-prompts` kept; each prompt
is BOS (where the model has one) and its piece. `--prompts S [S ...]`: each string encoded as one prompt,
BOS first.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="checkpoint directory, hub id, or 'demo'")
    ap.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    ap.add_argument("--dtype", default=None, help="activations (default: float32 on the CPU, else bfloat16)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="cache bytes (default: the engine's)")


def add_prompt_args(ap: argparse.ArgumentParser, prompt_len: int = 64, max_prompts: int = 32) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", type=Path, help="UTF-8 text file the prompts are cut from")
    src.add_argument("--prompts", nargs="+", help="prompt strings (instead of --file)")
    ap.add_argument("--prompt-len", type=int, default=prompt_len, help="tokens per prompt cut from --file")
    ap.add_argument("--max-prompts", type=int, default=max_prompts, help="prompts cut from --file, at most")
    ap.add_argument("--skip-prompts", type=int, default=0, help="pieces of --file dropped before the first prompt")


def check_positive(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < 1:
            ap.error(f"--{name} must be >= 1, got {value}")


def engine(args: argparse.Namespace, **options):
    """LLM from the engine options (`options`: any other LLM keyword, e.g. num_speculative_tokens)."""
    import torch

    from deepinfer import LLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    return LLM(args.model, device=device, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
               max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, **options)


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


def run_main(run: Callable[[list[str] | None], dict], argv: list[str] | None) -> int:
    """A tool's main: prints the JSON object `run(argv)` returns as one line; the exit status."""
    print(json.dumps(run(argv)))
    return 0


def prompts(llm, args: argparse.Namespace) -> list[list[int]]:
    """The prompts `add_prompt_args` describes, as token ids."""
    if llm.detokenizer is None:
        raise ValueError("--model: the checkpoint has no tokenizer to read prompts with")
    bos = llm.model.config.bos_token_id
    if args.prompts is not None:
        return [llm.detokenizer.encode(p, bos) for p in args.prompts]
    tokens = llm.detokenizer.encode(args.file.read_text(encoding="utf-8"), None)
    out = cut_prompts(tokens, args.prompt_len, args.max_prompts, bos, args.skip_prompts)
    if not out:
        raise ValueError(f"--file: {len(tokens)} tokens, fewer than (--skip-prompts={args.skip_prompts} + 1) x "
                         f"--prompt-len={args.prompt_len}")
    return out
