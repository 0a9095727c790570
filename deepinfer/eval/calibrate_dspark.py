"""Fit the DSpark confidence temperatures from held-out text and save them in the checkpoint directory.

    python -m deepinfer.eval.calibrate_dspark --model DIR --file held_out.txt [--gamma 5] [--prompt-len 64]
        [--max-tokens 64] [--max-prompts 64] [--out DIR]

The text is tokenised and cut into prompts of --prompt-len tokens; the model generates --max-tokens
greedy tokens after each with its own draft stages at a fixed length of gamma (no confidence scheduling),
so every verify step logs the confidences the drafter gave its gamma drafts and how many the target
accepted: exactly the acceptance the engine sees. Sequential temperature scaling (spec/calibration.py)
then fits one temperature per position on the blocks drafted in full, and `dspark_calibration.json`
is written into --out (default: the model directory), which LLM reads at start-up when
enable_mtp_varlen is on. Prints one JSON object: the temperatures, the ECE of the cumulative survival
per position before and after, and the number of blocks.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from deepinfer.spec.calibration import fit


def _logit(c: float) -> float:
    c = min(max(c, 1e-7), 1 - 1e-7)
    return math.log(c) - math.log1p(-c)


def calibration_data(llm, token_ids: list[int], gamma: int, prompt_len: int, max_tokens: int,
                     max_prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """(confidence logits [N, gamma], accepted drafts [N]) of the verify steps that checked gamma drafts."""
    from deepinfer.sampling_params import SamplingParams

    prompts = [token_ids[i:i + prompt_len] for i in range(0, len(token_ids) - prompt_len + 1, prompt_len)]
    prompts = prompts[:max_prompts]
    if not prompts:
        raise ValueError(f"--file: fewer than --prompt-len={prompt_len} tokens of text")
    sched = llm.scheduler
    sched.spec_log = []
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        log = [(conf, acc) for conf, drafted, acc in sched.spec_log if drafted == gamma and len(conf) == gamma]
    finally:
        sched.spec_log = None
    if not log:
        raise ValueError("no verify step checked a full block of drafts: raise --max-tokens or --max-prompts")
    return (np.array([[_logit(c) for c in conf] for conf, _ in log]), np.array([acc for _, acc in log]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory with DSpark draft stages")
    p.add_argument("--file", required=True, help="held-out text")
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per block (DEEPINFER_USE_NEXTN_DECODE)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default=None, help="directory for dspark_calibration.json (default: --model)")
    args = p.parse_args(argv)
    from deepinfer import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_speculative_tokens=args.gamma,
              enable_mtp_varlen=False)
    if llm.detokenizer is None:
        raise ValueError("--model: the checkpoint has no tokenizer to read --file with")
    ids = llm.detokenizer.encode(Path(args.file).read_text(), None)
    logits, accepted = calibration_data(llm, ids, args.gamma, args.prompt_len, args.max_tokens, args.max_prompts)
    cal = fit(logits, accepted)
    path = cal.save(args.out or llm.model_dir)
    summary = dict(path=str(path), temperatures=list(cal.temperatures), ece_before=list(cal.ece_before),
                   ece_after=list(cal.ece_after), num_blocks=cal.num_blocks)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
