"""Probe: the trained demo's bf16 gap to NeMo's fp32 (teacher-forced, DEMO_PROMPTS x 10 greedy tokens) under
engine variants that change only kernels and summation orders (graphs / eager, batch_invariant, synchronous), on
the GPU and the CPU's bf16 reference of the same host: the five largest top-5 gaps with the chosen token's gap,
the step and the lowest top-5 logprob, and the mean chosen-token gap. Sets the GPU test's BF16_ORDER_SPREAD.

    PYTHONPATH=.:<a folder holding nemo_automodel> TORCHDYNAMO_DISABLE=1 python benchmarks/bf16_gap_variants.py
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import torch
from nemo_oracle import demo_prompts, nemo_v41_logits, nemo_v41_model
from deepinfer import LLM, SamplingParams
from deepinfer.tools.demo import DEMO_DIR
nemo = nemo_v41_model(DEMO_DIR)[0]
def gaps(llm, kv):
    prompts = demo_prompts(llm.detokenizer.tok)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    rows = []
    for p, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        seq = list(p)
        for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            ref = nemo_v41_logits(nemo, torch.tensor([seq]), exact=kv != "auto")[0, -1].log_softmax(-1)
            d = {t: abs(v - ref[t].item()) for t, v in lp.items()}
            rows.append((max(d.values()), d[tok], i, min(lp.values())))
            seq.append(tok)
    rows.sort(reverse=True)
    mean_top1 = sum(r[1] for r in rows) / len(rows)
    print(f"  worst5 (max top5 gap, chosen-token gap, step, lowest logprob in top5): {[tuple(round(x,3) for x in r) for r in rows[:5]]}; mean chosen gap {mean_top1:.4f}", flush=True)
for dev, kw in [("cuda", {}), ("cuda", {"enforce_eager": True}), ("cuda", {"batch_invariant": True}), ("cuda", {"async_scheduling": False, "enforce_eager": True}), ("cpu", {})]:
    for kv in ("bfloat16", "auto"):
        if dev == "cpu" and kv == "auto": continue
        llm = LLM(str(DEMO_DIR), device=dev, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=16, yoco_prefill_truncation_mode="none", **kw)
        print(dev, kv, kw, flush=True)
        gaps(llm, kv)
        llm.close()
