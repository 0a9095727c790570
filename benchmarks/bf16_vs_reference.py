"""How far deepinfer's bf16 is from the fp32 reference implementations, teacher-forced, on tiny random
checkpoints: V4 against transformers' DeepseekV4ForCausalLM, V4.1 against NeMo AutoModel's
deepseek_v41. Greedy generations through `LLM` (4 prompts x 10 tokens, chunked prefill), then the
reference's fp32 logits on every generated prefix; reports the largest |logprob - reference| over the
top-5 logprobs deepinfer returns and how often the reference's argmax is the token deepinfer chose.
Needs the test dependencies (transformers, nemo_automodel).

    PYTHONPATH=. python benchmarks/bf16_vs_reference.py [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from nemo_oracle import nemo_v41_logits, nemo_v41_model, teacher_forced_gap  # noqa: E402
from oracle import transformers_model  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.loader.model_loader import load_model  # noqa: E402
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint  # noqa: E402

CASES = {  # arch: (preset, engine settings (dtype, kv_cache_dtype) measured)
    "v4": ({**PRESETS["tiny"], "index_topk": 64}, [("float32", "float32"), ("bfloat16", "bfloat16")]),
    "v41": (PRESETS["tiny41"], [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "auto")]),
}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[0] + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 30, 17, 44)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for arch, (preset, settings) in CASES.items():
            ckpt = write_checkpoint(Path(tmp) / arch, preset, seed=0, dtype="fp8")
            if arch == "v4":
                hf = transformers_model(load_model(str(ckpt), dtype=torch.float32)[0], Path(tmp))
                vocab = preset["vocab_size"]
            else:
                nemo = nemo_v41_model(ckpt)[0]
                vocab = preset["text_config"]["vocab_size"]
            for dtype, kv in settings:
                if arch == "v4":
                    ref = lambda seq: hf(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)  # noqa: E731
                else:
                    ref = lambda seq: nemo_v41_logits(nemo, torch.tensor([seq]),  # noqa: E731
                                                      exact=kv != "auto")[0, -1].log_softmax(-1)
                llm = LLM(str(ckpt), device=args.device, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                          max_num_batched_tokens=16, yoco_prefill_truncation_mode="none")
                worst, agree, total = teacher_forced_gap(llm, prompts(vocab), ref)
                print(f"{arch} {args.device} dtype {dtype} kv {kv}: max |logprob - reference fp32| over the top-5 "
                      f"{worst:.4f}; reference argmax = deepinfer's token at {agree} / {total} positions", flush=True)


if __name__ == "__main__":
    main()
