"""How far each parallel layout's outputs are from one process's on the CPU (gloo ranks, fp32, the
tiny V4 checkpoint in its shipped layout): for TP=2, TP=4, DP=2 + EP, DP=4 + EP + EPLB (every 2
steps) and CP=2, whether the greedy tokens are equal and the largest |logprob difference| over
every returned top-k logprob. What the README quotes for the parallel paths.

    python benchmarks/parallel_parity.py --out benchmarks/results/<date>-cpu-parallel-parity.txt
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import add_commit_arg, recorded_commit, refuse_existing_out

from deepinfer import LLM, SamplingParams
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = {**PRESETS["tiny"], "index_topk": 64}  # top-k >= entries: no indexer near-ties between layouts
LAYOUTS = {"tp=2": dict(tensor_parallel_size=2), "tp=4": dict(tensor_parallel_size=4),
           "dp=2 + ep": dict(data_parallel_size=2, enable_expert_parallel=True),
           "dp=4 + ep + eplb every 2 steps": dict(data_parallel_size=4, enable_expert_parallel=True, enable_eplb=True,
                                                  eplb_config={"step_interval": 2, "window_size": 2}),
           "cp=2": dict(context_parallel_size=2)}


def run(ckpt: Path, prompts, params, **kw) -> list:
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
              max_num_batched_tokens=512, skip_tokenizer_init=True, **kw)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commit_arg(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    refuse_existing_out(args)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    long = [0] + [(i * 37 + 11) % 1000 + 2 for i in range(255)]  # 256 tokens: CP splits its prefill
    prompts = {"cp=2": [long]}
    lines = [f"# commit {recorded_commit(args)}: python benchmarks/parallel_parity.py (CPU, gloo, fp32, tiny V4)"]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", CFG, seed=11, dtype="fp8")
        for name, kw in LAYOUTS.items():
            ps = prompts.get(name, [long[:20], long[40:44], long[100:137]])
            want = [run(ckpt, [p], params)[0] for p in ps]  # each prompt alone, as CP needs
            got = run(ckpt, ps, params, **kw) if name != "cp=2" else [run(ckpt, [p], params, **kw)[0] for p in ps]
            same = all(g.token_ids == w.token_ids for g, w in zip(got, want))
            diff = max(abs(gl[t] - wl[t]) for g, w in zip(got, want) for gl, wl in zip(g.logprobs, w.logprobs)
                       for t in wl)
            lines.append(f"{name:<32} greedy tokens equal: {same}   max |logprob difference|: {diff:.2e}")
            print(lines[-1], flush=True)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / "parallel-parity.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
