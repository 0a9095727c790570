"""deepinfer command line: `deepinfer generate --model M --prompt "..." [sampling flags]`."""
from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> None:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.max_model_len, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n,
                            seq_seed=args.seq_seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        for c in out.outputs:
            print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}, ensure_ascii=False))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="deepinfer")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for one or more prompts")
    g.add_argument("--model", default=None, help="local dir, hub id, or 'demo' (default: DEEPINFER_HF_MODEL_DIR)")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "bfloat16", "float32"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--seq-seed", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        _generate(args)
    except ValueError as e:
        sys.exit(f"deepinfer: error: {e}")


if __name__ == "__main__":
    main()
