"""How far deepinfer's V4.1 is from NeMo AutoModel's fp32 reference per dtype, teacher-forced: greedy
generations through `LLM` (tiny41 checkpoint, 4 prompts x 10 tokens, chunked prefill), then NeMo's
fp32 logits on every generated prefix; reports the largest |logprob - NeMo's| over the top-5
logprobs deepinfer returns and how often NeMo's argmax is the token deepinfer chose. Needs
nemo_automodel (a test dependency).

    PYTHONPATH=. python benchmarks/v41_bf16_vs_nemo.py [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from nemo_oracle import nemo_v41_logits, nemo_v41_model  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default="/tmp/v41-bf16-vs-nemo")
    args = ap.parse_args()
    ckpt = write_checkpoint(Path(args.dir) / "ckpt", PRESETS["tiny41"], seed=0, dtype="fp8")
    nemo = nemo_v41_model(ckpt)[0]
    g = torch.Generator().manual_seed(3)
    prompts = [[0] + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 30, 17, 44)]
    for dtype, kv in (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "auto")):
        llm = LLM(str(ckpt), device=args.device, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=16, yoco_prefill_truncation_mode="none")
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
        worst, agree, total = 0.0, 0, 0
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            seq = list(prompt)
            for tok, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
                with torch.inference_mode():
                    ref = nemo_v41_logits(nemo, torch.tensor([seq]), exact=kv != "auto")[0, -1].log_softmax(-1)
                worst = max(worst, max(abs(v - ref[t].item()) for t, v in lp.items()))
                agree += int(ref.argmax()) == tok
                total += 1
                seq.append(tok)
        print(f"{args.device} dtype {dtype} kv {kv}: max |logprob - NeMo fp32| over the top-5 {worst:.4f}; "
              f"NeMo's argmax = deepinfer's token at {agree} / {total} positions", flush=True)


if __name__ == "__main__":
    main()
