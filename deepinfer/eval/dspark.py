"""DSpark acceptance per draft position and the calibration (ECE) of the draft confidences, greedy.

    python -m deepinfer.eval.dspark --model M (--file F | --prompts S [S ...]) [--max-tokens N] [--gamma G]
                                    [--prompt-len L] [--max-prompts P] [--bins B] [--device D] ...

The engine generates N greedy tokens (ignore_eos) after each prompt with its own draft stages at a fixed
length of G drafts (no confidence scheduling), so every verify step checks the block the drafter gave it.
Acceptance comes from the engine's counters (LLM.get_metrics(), counted over this run): position i's
`acceptance_per_position` is accepted_per_position[i] / drafted_per_position[i], the share of the blocks
drafted that far whose drafts 1..i were all accepted, and `mean_acceptance_length` counts the target's own
token (1 + accepted drafts per verify step). Calibration comes from the scheduler's log of every verified
block (the confidences the drafter gave its drafts, how many it drafted, how many were accepted): at position
i, over the blocks drafted that far,
  - `ece_per_position`: the survival a_i = c_1 * ... * c_i (the scheduler's estimate that drafts 1..i
    are all accepted) against whether they were (spec/calibration.py's ECE and survival, as
    eval/calibrate_dspark.py fits them);
  - `ece_conditional_per_position`: c_i against whether draft i was accepted, over the blocks whose drafts
    1..i-1 were accepted;
  - `ece_calibrated_per_position` (when the checkpoint has dspark_calibration.json): the survival of the
    temperature-scaled confidences, as the engine's confidence scheduler uses them.
"""
from __future__ import annotations

import sys

import numpy as np

from deepinfer.spec.calibration import DEFAULT_BINS, ece
from deepinfer.spec.ngram import ModelDrafts
from deepinfer.eval.common import Parser, add_engine_args, add_prompt_args, at_least, engine, prompts, run_main, source

PROG = "python -m deepinfer.eval.dspark"
# one verified block: (the drafter's confidences of its drafts, drafts verified, drafts accepted)
Block = tuple[list[float], int, int]


def survival_rows(log: list[Block], i: int) -> tuple[np.ndarray, np.ndarray]:
    """(a_i, label) over the blocks drafted past position i (0-based): a_i = product of the confidences of
    drafts 0..i, label 1.0 where drafts 0..i were all accepted."""
    rows = [(float(np.prod(conf[:i + 1])), float(acc > i)) for conf, drafted, acc in log if drafted > i]
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows])


def conditional_rows(log: list[Block], i: int) -> tuple[np.ndarray, np.ndarray]:
    """(c_i, label) over the blocks drafted past position i whose drafts 0..i-1 were accepted."""
    rows = [(conf[i], float(acc > i)) for conf, drafted, acc in log if drafted > i and acc >= i]
    return np.array([r[0] for r in rows], dtype=np.float64), np.array([r[1] for r in rows])


def ece_per_position(log: list[Block], rows, bins: int = DEFAULT_BINS) -> list[float | None]:
    """ECE at each draft position of the (prediction, label) pairs `rows(log, i)` gives (None: no pair)."""
    depth = max((d for _, d, _ in log), default=0)
    out = []
    for i in range(depth):
        pred, label = rows(log, i)
        out.append(ece(pred, label, bins) if pred.size else None)
    return out


def calibrated(log: list[Block], temperatures) -> list[Block]:
    """The log with each confidence c_i replaced by sigmoid(logit(c_i) / T_i), as the scheduler scales them."""
    from deepinfer.spec.calibration import _sigmoid
    from deepinfer.eval.calibrate_dspark import _logit

    out = []
    for conf, drafted, acc in log:
        t = np.asarray(temperatures[:len(conf)], dtype=np.float64)
        z = np.array([_logit(c) for c in conf[:len(t)]])
        out.append((_sigmoid(z / t).tolist() + list(conf[len(t):]), drafted, acc))
    return out


def _since(after: dict, before: dict) -> dict:
    """Counters of get_metrics() accumulated between two reads."""
    def minus(a, b):
        if isinstance(a, list):
            return [x - (b[k] if k < len(b) else 0) for k, x in enumerate(a)]
        return a - b
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "drafted_per_position")
    return {k: minus(after[k], before[k]) for k in keys}


def evaluate(llm, prompt_ids: list[list[int]], max_tokens: int, bins: int = DEFAULT_BINS,
             temperatures=None) -> dict:
    """Generate greedily after every prompt and measure the drafts the engine verified (see the module doc)."""
    from deepinfer import SamplingParams

    sched = llm.scheduler
    if not isinstance(sched.proposer, ModelDrafts):
        raise ValueError("llm: needs an engine drafting with the checkpoint's own draft layers (DSpark or MTP: "
                         f"num_speculative_tokens), got proposer {sched.proposer!r}")
    before = llm.get_metrics()
    sched.spec_log = []
    try:
        llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
        log = [(list(conf), drafted, acc) for conf, drafted, acc in sched.spec_log]
    finally:
        sched.spec_log = None
    m = _since(llm.get_metrics(), before)
    if not m["num_drafts"]:
        raise ValueError("no verify step checked a draft: raise --max-tokens")
    result = {
        "prompts": len(prompt_ids), "max_tokens": max_tokens, "method": sched.proposer.method,
        "gamma": sched.proposer.num_speculative_tokens, "bins": bins, **m,
        "mean_acceptance_length": 1 + m["num_accepted_tokens"] / m["num_drafts"],
        "acceptance_per_position": [a / d if d else None for a, d in zip(m["accepted_per_position"],
                                                                         m["drafted_per_position"])],
        "mean_confidence_per_position": [float(a.mean()) if a.size else None
                                         for a, _ in (survival_rows(log, i) for i in range(len(m["drafted_per_position"])))],
        "ece_per_position": ece_per_position(log, survival_rows, bins),
        "ece_conditional_per_position": ece_per_position(log, conditional_rows, bins),
    }
    if temperatures is not None:
        result["temperatures"] = list(temperatures)
        result["ece_calibrated_per_position"] = ece_per_position(calibrated(log, temperatures), survival_rows, bins)
    return result


def run(argv: list[str] | None = None) -> dict:
    """The JSON object the command prints, from its arguments."""
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    add_prompt_args(ap)
    ap.add_argument("--max-tokens", type=at_least(1), default=64, help="greedy tokens generated per prompt")
    ap.add_argument("--gamma", type=at_least(1), default=5, help="drafts per block (num_speculative_tokens)")
    ap.add_argument("--bins", type=at_least(1), default=DEFAULT_BINS, help="equal-width ECE bins of [0, 1]")
    args = ap.parse_args(argv)
    from deepinfer.llm import _calibration

    llm = engine(args, num_speculative_tokens=args.gamma, enable_mtp_varlen=False)
    return {"model": str(llm.model_dir), **source(args),
            **evaluate(llm, prompts(llm, args), args.max_tokens, args.bins, _calibration(llm.model_dir))}


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main())
