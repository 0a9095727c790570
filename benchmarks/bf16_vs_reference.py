"""How far deepinfer's bf16 is from the fp32 reference implementations, teacher-forced: V4 against
transformers' DeepseekV4ForCausalLM and V4.1 against NeMo AutoModel's deepseek_v41 on tiny random
checkpoints (cases v4, v41), and V4.1 on the trained demo (case demo41: deepinfer/assets/demo41, text
prompts tests/models/nemo_oracle.DEMO_PROMPTS). Greedy generations through `LLM` (4 prompts x 10 tokens,
chunked prefill), then the reference's fp32 logits on every generated prefix; reports the largest
|logprob - reference| over the top-5 logprobs deepinfer returns and how often the reference's argmax is
the token deepinfer chose. Random weights make near-ties everywhere, so bf16 alone moves them by nats;
the trained demo is what bounds the GPU test (tests/models/test_deepseek_v41.py). Needs the test
dependencies (transformers, nemo_automodel).

    PYTHONPATH=. python benchmarks/bf16_vs_reference.py [--device cpu|cuda] [--cases v4,v41,demo41] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from common import add_commit_arg, recorded_commit, refuse_existing_out, write_results  # noqa: E402
from nemo_oracle import demo_prompts, nemo_v41_logits, nemo_v41_model, teacher_forced_gap  # noqa: E402
from oracle import transformers_model  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.loader.model_loader import load_model  # noqa: E402
from deepinfer.tools.demo import DEMO_DIR  # noqa: E402
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint  # noqa: E402

SETTINGS_V41 = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "auto")]
CASES = {  # case: (preset (None: the trained demo), engine settings (dtype, kv_cache_dtype) measured)
    "v4": ({**PRESETS["tiny"], "index_topk": 64}, [("float32", "float32"), ("bfloat16", "bfloat16")]),
    "v41": (PRESETS["tiny41"], SETTINGS_V41),
    "demo41": (None, SETTINGS_V41 + [("float32", "auto")]),
}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[0] + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 30, 17, 44)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default="v4,v41", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes measured")
    ap.add_argument("--out", default=None, help="results JSON (default: printed lines only)")
    add_commit_arg(ap)
    args = ap.parse_args()
    refuse_existing_out(args)
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        ap.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            preset, settings = CASES[case]
            ckpt = DEMO_DIR if preset is None else write_checkpoint(Path(tmp) / case, preset, seed=0, dtype="fp8")
            if case == "v4":
                hf = transformers_model(load_model(str(ckpt), dtype=torch.float32)[0], Path(tmp))
            else:
                nemo = nemo_v41_model(ckpt)[0]
            for dtype, kv in settings:
                if dtype not in args.dtypes.split(","):
                    continue
                if case == "v4":
                    ref = lambda seq: hf(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)  # noqa: E731
                else:
                    ref = lambda seq: nemo_v41_logits(nemo, torch.tensor([seq]),  # noqa: E731
                                                      exact=kv != "auto")[0, -1].log_softmax(-1)
                llm = LLM(str(ckpt), device=args.device, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                          max_num_batched_tokens=16, yoco_prefill_truncation_mode="none")
                if preset is None:
                    ids = demo_prompts(llm.detokenizer.tok)
                else:
                    text = preset.get("text_config", preset)
                    ids = prompts(text["vocab_size"])
                worst, agree, total = teacher_forced_gap(llm, ids, ref)
                llm.close()
                rows.append({"case": case, "device": args.device, "dtype": dtype, "kv_cache_dtype": kv,
                             "max_abs_logprob_gap": worst, "argmax_agree": agree, "positions": total})
                print(f"{case} {args.device} dtype {dtype} kv {kv}: max |logprob - reference fp32| over the top-5 "
                      f"{worst:.4f}; reference argmax = deepinfer's token at {agree} / {total} positions", flush=True)
    if args.out:
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        result = {"device": gpu, "date": str(date.today()), "commit": recorded_commit(args),
                  "command": "PYTHONPATH=. python benchmarks/bf16_vs_reference.py " + " ".join(sys.argv[1:]),
                  "rows": rows}
        print(f"wrote {write_results(args.out, json.dumps(result, indent=2) + chr(10))}")


if __name__ == "__main__":
    main()
