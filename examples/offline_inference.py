"""Offline inference with deepinfer.

    python examples/offline_inference.py --model demo          # small trained model, CPU is fine
    python examples/offline_inference.py --model /path/to/DeepSeek-V4-Flash --device cuda

--model defaults to DEEPINFER_HF_MODEL_DIR, else the hub id deepseek-ai/DeepSeek-V4.1-Flash-1017.
"""
from __future__ import annotations

import argparse
import time

import torch

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):\n",
    'class Stack:\n    """A last-in, first-out collection."""\n\n    def __init__(self):\n',
    "The capital of France is",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local dir, hub id, or 'demo'")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    print(f"loaded {llm.model_dir} on {args.device} in {time.perf_counter() - t0:.1f}s")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - t0
    for out in outputs:
        print(f"\nPrompt: {out.prompt!r}\nCompletion: {out.outputs[0].text!r}")
    emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {emitted} tokens emitted in {elapsed:.2f}s: "
          f"{len(outputs) / elapsed:.2f} req/s, {emitted / elapsed:.1f} output tok/s")


if __name__ == "__main__":
    main()
