"""Held-out perplexity: the engine's own logprobs of a text file's tokens, teacher-forced.

    python -m deepinfer.eval.perplexity --model M --file F [--max-tokens N] [--window W] [--context C]
                                        [--device D] [--reference nemo|transformers]

prints one JSON object: `perplexity` = exp(-mean logprob) over `tokens` scored tokens, and with
`--reference` the same tokens scored by the reference implementation and the differences.

The file is tokenized whole, without BOS, and cut into windows of at most W tokens (default: the
engine's max_model_len - 1, the longest prompt it takes). Each window is one prompt: BOS, then C
tokens of context (the tokens just before the window's own, not scored; 0 by default), then the
window's own tokens, every one of them scored from the prompt's prefix (SamplingParams.prompt_logprobs).
Windows do not overlap in the tokens they score, so every file token is scored exactly once; a token
near the start of a window sees only BOS and the C context tokens before it.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deepinfer.eval.common import Parser, add_engine_args, at_least, engine, read_text, run_main, text_file

PROG = "python -m deepinfer.eval.perplexity"
ROOT = Path(__file__).resolve().parents[2]  # a source checkout: the references are the oracles of its tests/models
REFERENCES = ("nemo", "transformers")


@dataclass(frozen=True)
class Window:
    """One prompt: token_ids, of which positions first.. are scored (first >= 1: position 0 is never)."""

    token_ids: list[int]
    first: int

    @property
    def scored(self) -> list[tuple[int, int]]:
        """(position, token) of every scored token."""
        return [(p, self.token_ids[p]) for p in range(self.first, len(self.token_ids))]


def make_windows(tokens: list[int], width: int, bos: int | None, context: int = 0) -> list[Window]:
    """`tokens` cut into prompts of at most `width` tokens (BOS and `context` unscored tokens included) that
    score every token once, in order. Without BOS a window's first token has no prefix: it is scored as
    context of the next window only (the file's first token is then never scored)."""
    prefix = [] if bos is None else [bos]
    lead = context + (bos is None)  # unscored file tokens before a window's own (without BOS: one more)
    own = width - len(prefix) - lead
    if own < 1:
        raise ValueError(f"--window: {width} tokens leave no room to score any after BOS and --context={context}")
    out, i = [], 0 if bos is not None else 1
    while i < len(tokens):
        ctx = tokens[max(0, i - lead):i]
        ids = prefix + ctx + tokens[i:i + own]
        out.append(Window(ids, len(prefix) + len(ctx)))
        i += own
    return out


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def engine_logprobs(llm, windows: list[Window]) -> list[list[float]]:
    """The engine's logprob of every scored token, per window (one generate call: the engine batches them)."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([w.token_ids for w in windows], params, use_tqdm=False)
    return [[o.prompt_logprobs[p][t] for p, t in w.scored] for w, o in zip(windows, outs)]


def check_reference(name: str, model_type: str) -> None:
    want = {"nemo": "deepseek_v41", "transformers": "deepseek_v4"}[name]
    if model_type != want:
        raise ValueError(f"--reference: {name!r} is the reference for {want}; this checkpoint is {model_type} "
                         f"(use --reference {'nemo' if model_type == 'deepseek_v41' else 'transformers'})")


def reference_logprobs(name: str, model_dir: Path, model_type: str, windows: list[Window],
                       exact: bool) -> list[list[float]]:
    """The same tokens scored by a full-sequence fp32 forward of the reference implementation on the CPU
    (the oracles of tests/models: NeMo AutoModel's deepseek_v41, transformers' DeepseekV4ForCausalLM).
    `exact`: the engine stores exact cache values, so NeMo's cache quantisation round trips are dropped."""
    import torch

    check_reference(name, model_type)
    if not (ROOT / "tests" / "models").is_dir():
        raise ValueError(f"--reference: the references are the test oracles of a source checkout (tests/models), "
                         f"not installed with the package; none at {ROOT}")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo runs eagerly
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    if name == "nemo":
        from nemo_oracle import nemo_v41_logits, nemo_v41_model

        model = nemo_v41_model(model_dir)[0]
        forward = lambda ids: nemo_v41_logits(model, ids, exact=exact)[0]  # noqa: E731
    else:
        from oracle import transformers_model

        from deepinfer.loader.model_loader import load_model

        dense = load_model(str(model_dir), dtype=torch.float32, device="cpu")[0]
        with tempfile.TemporaryDirectory() as tmp:
            model = transformers_model(dense, Path(tmp))
        del dense
        forward = lambda ids: model(ids).logits[0].float()  # noqa: E731
    out = []
    with torch.inference_mode():
        for w in windows:
            lp = forward(torch.tensor([w.token_ids])).log_softmax(-1)
            out.append([lp[p - 1, t].item() for p, t in w.scored])
    return out


def evaluate(llm, text: str, max_tokens: int | None = None, window: int | None = None, context: int = 0,
             reference: str | None = None) -> dict:
    """The JSON object `main` prints, for an engine `llm` (with its tokenizer) and the text to score."""
    cfg = llm.model.config
    if reference is not None:
        check_reference(reference, cfg.model_type)
    tokens = llm.detokenizer.encode(text, None)[:max_tokens]
    width = window or llm.max_model_len - 1
    if not 2 <= width < llm.max_model_len:
        raise ValueError(f"--window: {width} must be in [2, max_model_len={llm.max_model_len}) (one token must "
                         "fit after a prompt)")
    windows = make_windows(tokens, width, cfg.bos_token_id, context)
    if not windows:
        raise ValueError("--file: no token to score (the text is empty, or one token without BOS)")
    ours = engine_logprobs(llm, windows)
    flat = [x for w in ours for x in w]
    result = {"model": str(llm.model_dir), "tokens": len(flat), "windows": len(windows), "window": width,
              "context": context, "perplexity": perplexity(flat), "mean_logprob": sum(flat) / len(flat)}
    if reference is not None:
        exact = llm.config.kv_cache_dtype in ("float32", "bfloat16")
        ref = [x for w in reference_logprobs(reference, Path(llm.model_dir), cfg.model_type, windows, exact)
               for x in w]
        diff = [abs(a - b) for a, b in zip(flat, ref)]
        result.update({"reference": reference, "reference_perplexity": perplexity(ref),
                       "perplexity_diff": result["perplexity"] - perplexity(ref),
                       "max_abs_logprob_diff": max(diff), "mean_abs_logprob_diff": sum(diff) / len(diff)})
    return result


def run(argv: list[str] | None = None) -> dict:
    """The JSON object the command prints, from its arguments."""
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--file", required=True, type=text_file, help="UTF-8 text file to score")
    ap.add_argument("--max-tokens", type=at_least(1), default=None, help="score the file's first N tokens only")
    ap.add_argument("--window", type=at_least(2), default=None, help="tokens per prompt (default: max_model_len - 1)")
    ap.add_argument("--context", type=at_least(0), default=0,
                    help="unscored tokens of the previous window each repeats")
    ap.add_argument("--reference", choices=REFERENCES, default=None,
                    help="also score with the reference (fp32 on the CPU; small checkpoints only)")
    args = ap.parse_args(argv)
    text = read_text(args.file)
    llm = engine(args)
    return {"file": str(args.file), **evaluate(llm, text, args.max_tokens, args.window, args.context, args.reference)}


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main())
