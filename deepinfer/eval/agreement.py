"""Greedy agreement of the engine with the reference implementation (NeMo for V4.1, transformers for V4).

    python -m deepinfer.eval.agreement --model M (--file F | --prompts S [S ...]) [--max-tokens N]
                                       [--reference nemo|transformers] [--prompt-len L] [--max-prompts P]
                                       [--device D] ...

The engine generates N greedy tokens (ignore_eos) after each prompt. The reference (deepinfer.eval.perplexity's: a
full-sequence fp32 forward on the CPU, small checkpoints only) then reads each prompt with the engine's
continuation, teacher-forced, and gives its whole next-token distribution at every continuation position.
Position i agrees when the reference's argmax is the engine's token i. Since both run greedily from the same
prefix, the reference's own greedy continuation is the engine's up to the first position that disagrees:
`mean_common_prefix` is that length (N when none does), `identical_completions` the share of prompts with no
disagreement, `greedy_agreement` the share of all positions that agree (teacher-forced). `first_mismatch_margins`
gives, for each prompt that disagrees, the reference's logprob of its own argmax minus that of the engine's
token at the first disagreement (near 0: a near tie that rounding can flip; large: a real difference).
`--reference` defaults to the checkpoint's (nemo for deepseek_v41, transformers for deepseek_v4).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from deepinfer.eval.common import Parser, add_engine_args, add_prompt_args, at_least, engine, prompts, run_main, source
from deepinfer.eval.perplexity import REFERENCES, Window, check_reference, reference_logprobs

PROG = "python -m deepinfer.eval.agreement"


@dataclass(frozen=True)
class Continuation(Window):
    """A prompt and a continuation (positions first..): every vocabulary entry is scored at every continuation
    position, so reference_logprobs returns the whole distribution there ([V] per position, in order)."""

    vocab: int = 0

    @property
    def scored(self) -> list[tuple[int, int]]:
        return [(p, t) for p in range(self.first, len(self.token_ids)) for t in range(self.vocab)]


def compare(engine_tokens: list[list[int]], reference_rows: list[list[list[float]]]) -> dict:
    """The module doc's fields from the engine's continuations and the reference's logprob rows ([N][V] per
    prompt, row i the distribution of continuation token i)."""
    agree, prefixes, margins = 0, [], []
    for toks, rows in zip(engine_tokens, reference_rows):
        hits = []
        for t, row in zip(toks, rows):
            best = max(range(len(row)), key=row.__getitem__)
            hits.append(row[best] == row[t])  # (a tie counts as agreement: either is the reference's greedy pick)
        agree += sum(hits)
        first = hits.index(False) if False in hits else len(hits)
        prefixes.append(first)
        if first < len(hits):
            margins.append(max(rows[first]) - rows[first][toks[first]])
    n = sum(len(t) for t in engine_tokens)
    return {"greedy_agreement": agree / n, "identical_completions": sum(p == len(t) for p, t in
                                                                        zip(prefixes, engine_tokens)) / len(prefixes),
            "mean_common_prefix": sum(prefixes) / len(prefixes), "common_prefix": prefixes,
            "first_mismatch_margins": margins}


def evaluate(llm, prompt_ids: list[list[int]], max_tokens: int, reference: str | None = None) -> dict:
    from deepinfer import SamplingParams

    cfg = llm.model.config
    reference = reference or ("nemo" if cfg.model_type == "deepseek_v41" else "transformers")
    check_reference(reference, cfg.model_type)
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    conts = [Continuation(p + t, len(p), cfg.vocab_size) for p, t in zip(prompt_ids, toks)]
    exact = llm.config.kv_cache_dtype in ("float32", "bfloat16")
    flat = reference_logprobs(reference, Path(llm.model_dir), cfg.model_type, conts, exact)
    rows = [[lp[i:i + cfg.vocab_size] for i in range(0, len(lp), cfg.vocab_size)] for lp in flat]
    return {"reference": reference, "prompts": len(prompt_ids), "max_tokens": max_tokens, **compare(toks, rows),
            "completions": toks}


def run(argv: list[str] | None = None) -> dict:
    """The JSON object the command prints, from its arguments."""
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    add_prompt_args(ap, prompt_len=64, max_prompts=8)
    ap.add_argument("--max-tokens", type=at_least(1), default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--reference", choices=REFERENCES, default=None,
                    help="default: the checkpoint's (nemo for V4.1, transformers for V4)")
    args = ap.parse_args(argv)
    llm = engine(args)
    return {"model": str(llm.model_dir), **source(args), **evaluate(llm, prompts(llm, args), args.max_tokens,
                                                                    args.reference)}


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main())
