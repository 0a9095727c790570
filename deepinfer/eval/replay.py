"""SWA bounded replay against the exact prefill, per KEEP: KL of the next-token distribution after each prompt
and the greedy agreement of the continuations.

    python -m deepinfer.eval.replay --model M (--file F | --prompts S [S ...]) [--keep K [K ...]] [--max-tokens N]
                                    [--prompt-len L] [--max-prompts P] [--device D] ...

Bounded replay (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact, KEEP rows = DEEPINFER_YOCO_PREFILL_KEEP_TOKENS)
runs the layers above the model's replay layer on each prompt's last KEEP rows only. One engine serves every
mode: its model runner's `replay_keep` is set to None (the exact prefill, mode `none`) or to each KEEP in turn
between runs; every KEEP is first checked by the engine's own start-up rule (it must cover the sliding window
plus the draft block). For each mode the engine runs
  - every prompt with max_tokens=1 and logprobs = the vocabulary size: the whole next-token distribution after
    the prompt (the raw model distribution, as the sampler sees it);
  - every prompt with N greedy tokens (ignore_eos).
Per KEEP, against the exact prefill: `kl_mean` / `kl_max` over prompts of KL(exact || KEEP) of that
distribution (nats), `top1_agreement` (same argmax), `greedy_agreement` (share of continuation positions with
the same token), `identical_completions` (share of prompts whose N tokens all match) and
`mean_common_prefix` (tokens before the first difference, averaged over prompts). A prompt no longer than
KEEP is prefilled exactly in both modes. benchmarks/bounded_replay.py measures the same deviation on one
random prompt outside the engine, with the prefill FLOPs (tests/eval/test_replay.py checks the KL against it).
"""
from __future__ import annotations

import dataclasses
import math
import sys

from deepinfer.eval.common import (Parser, UsageError, add_engine_args, add_prompt_args, at_least, engine, prompts,
                                   run_main, source)

PROG = "python -m deepinfer.eval.replay"
# LLM's max_logprobs: above any vocabulary, so a request may ask for all of it (the limit is min(this, vocab))
ALL_LOGPROBS = 1 << 30


def kl(exact: dict[int, float], other: dict[int, float]) -> float:
    """KL(exact || other) of two full next-token distributions given as {token: logprob}."""
    return math.fsum(math.exp(lp) * (lp - other[t]) for t, lp in exact.items())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_keep(llm, keep: int) -> int:
    """`keep` checked by the engine's own start-up rule (UsageError naming --keep)."""
    from deepinfer.llm import _replay_keep

    try:
        return _replay_keep(dataclasses.replace(llm.config, yoco_prefill_truncation_mode="compact",
                                                yoco_prefill_keep_tokens=keep), llm.model.config)
    except ValueError as e:
        raise UsageError(f"--keep {keep}: {e}") from None


def run_mode(llm, prompt_ids: list[list[int]], keep: int | None, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """(full next-token logprobs after each prompt, greedy continuations) with the runner's replay rows set to
    `keep` (None: the exact prefill)."""
    from deepinfer import SamplingParams

    runner = llm.engine.core.runner
    saved, runner.replay_keep = runner.replay_keep, keep
    try:
        vocab = llm.model.config.vocab_size
        first = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=1, logprobs=vocab), use_tqdm=False)
        greedy = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                              use_tqdm=False)
    finally:
        runner.replay_keep = saved
    return [o.outputs[0].logprobs[0] for o in first], [o.outputs[0].token_ids for o in greedy]


def deviation(exact: tuple[list[dict], list[list[int]]], other: tuple[list[dict], list[list[int]]]) -> dict:
    """The per-KEEP fields of the module doc, from run_mode's results in the exact mode and one KEEP."""
    (dist_e, toks_e), (dist_k, toks_k) = exact, other
    kls = [kl(e, k) for e, k in zip(dist_e, dist_k)]
    top1 = [max(e, key=e.get) == max(k, key=k.get) for e, k in zip(dist_e, dist_k)]
    same = [sum(x == y for x, y in zip(a, b)) for a, b in zip(toks_e, toks_k)]
    n = sum(len(a) for a in toks_e)
    return {"kl_mean": sum(kls) / len(kls), "kl_max": max(kls), "top1_agreement": sum(top1) / len(top1),
            "greedy_agreement": sum(same) / n, "identical_completions": sum(a == b for a, b in zip(toks_e, toks_k))
            / len(toks_e), "mean_common_prefix": sum(common_prefix(a, b) for a, b in zip(toks_e, toks_k)) / len(toks_e)}


def evaluate(llm, prompt_ids: list[list[int]], keeps: list[int], max_tokens: int) -> dict:
    if llm.model.replay_layer < 0:
        raise ValueError("--model: this model has no bounded replay (a DeepSeek-V4.1 checkpoint has; V4 has not)")
    keeps = [check_keep(llm, k) for k in keeps]
    exact = run_mode(llm, prompt_ids, None, max_tokens)
    lens = [len(p) for p in prompt_ids]
    return {"prompts": len(prompt_ids), "prompt_tokens_mean": sum(lens) / len(lens), "max_tokens": max_tokens,
            "replay_layer": llm.model.replay_layer, "num_layers": llm.model.config.num_hidden_layers,
            "kv_cache_dtype": llm.config.kv_cache_dtype,
            "per_keep": [{"keep": k, **deviation(exact, run_mode(llm, prompt_ids, k, max_tokens))} for k in keeps]}


def run(argv: list[str] | None = None) -> dict:
    """The JSON object the command prints, from its arguments."""
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    add_prompt_args(ap, prompt_len=512, max_prompts=16)
    ap.add_argument("--keep", type=at_least(1), nargs="+", default=[140], help="bounded-replay rows to compare (KEEP)")
    ap.add_argument("--max-tokens", type=at_least(1), default=64, help="greedy tokens generated per prompt")
    args = ap.parse_args(argv)
    llm = engine(args, max_logprobs=ALL_LOGPROBS, yoco_prefill_truncation_mode="compact",
                 yoco_prefill_keep_tokens=max(args.keep))
    return {"model": str(llm.model_dir), **source(args),
            **evaluate(llm, prompts(llm, args), args.keep, args.max_tokens)}


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main())
