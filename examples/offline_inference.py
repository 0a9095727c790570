"""Offline inference with deepinfer.

    python examples/offline_inference.py --model demo          # small random model, CPU is fine
    python examples/offline_inference.py --model /path/to/DeepSeek-V4-Flash --device cuda

--model defaults to DEEPINFER_HF_MODEL_DIR, else the hub id deepseek-ai/DeepSeek-V4.1-Flash-1017.
"""
from __future__ import annotations

import argparse
import time

import torch
from tokenizers import Tokenizer

from deepinfer.config import EngineConfig
from deepinfer.loader.model_loader import load_model
from deepinfer.tools.demo import DEMO_NAME, demo_checkpoint
from deepinfer.worker.greedy import greedy_generate
from deepinfer.worker.kv_cache import static_v4_cache

DEFAULT_HUB_ID = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
PROMPTS = [
    "The capital of France is",
    "In a distant galaxy, a small robot",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local dir, hub id, or 'demo'")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    cfg = EngineConfig.from_env(model=args.model, device=args.device, dtype=args.dtype,
                                kv_cache_dtype=args.kv_cache_dtype)
    model_ref = cfg.model or cfg.hf_model_dir or DEFAULT_HUB_ID
    if model_ref == DEMO_NAME:
        model_ref = str(demo_checkpoint())
    t0 = time.perf_counter()
    model, path = load_model(model_ref, dtype=getattr(torch, cfg.dtype), device=cfg.device,
                             hf_model_dir=cfg.hf_model_dir, offline=cfg.hf_hub_offline)
    print(f"loaded {path} on {cfg.device} in {time.perf_counter() - t0:.1f}s")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = model.config.bos_token_id
    prompts = [[bos] + tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    cache = static_v4_cache(model.config, len(prompts), max(map(len, prompts)) + args.max_tokens,
                              cfg.kv_cache_dtype, cfg.device)
    t0 = time.perf_counter()
    outs = greedy_generate(model, cache, prompts, args.max_tokens, model.config.eos_token_id)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(PROMPTS, outs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {tok.decode(out)!r}")
    emitted = sum(map(len, outs))
    print(f"\n{emitted} tokens emitted in {elapsed:.2f}s: {emitted / elapsed:.1f} tok/s "
          f"(greedy, {len(prompts)} requests, prefill included)")


if __name__ == "__main__":
    main()
