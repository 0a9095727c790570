"""Structured-output validity: the share of completions under `so_args` that parse and validate.

    python -m deepinfer.eval.structured --model M [--max-tokens N] [--samples K] [--temperature T] [--seed S]
                                        [--cases json,regex] [--device D] ...

Every built-in case (CASES: JSON schemas and regular expressions, each with its own prompt) is generated K
times (temperature T; K = 1 at temperature 0) under `so_args` {"schema_type": "json" | "regex", "schema": ...}.
A completion is valid when it ended by itself (finish_reason "stop", not cut at N tokens) and its text
passes the independent check: json.loads then jsonschema.validate for a schema, re.fullmatch for a regex.
Prints one JSON object: `validity_rate` (valid / completions), `truncated` (cut at N tokens), the rate per
kind and per case, and every completion that failed (case, finish_reason, text, why).
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

from deepinfer.eval.common import Parser, add_engine_args, at_least, engine, run_main

PROG = "python -m deepinfer.eval.structured"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "json" (schema: a JSON schema) or "regex" (schema: a pattern, matched whole)
    schema: dict | str
    prompt: str


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
CASES = (
    Case("person", "json", PERSON, "A person as JSON with a name and an age:\n"),
    Case("tags", "json", {"type": "array", "minItems": 1, "maxItems": 4,
                          "items": {"enum": ["python", "rust", "c", "go", "sql"]}},
         "Up to four language tags as a JSON array:\n"),
    Case("record", "json", {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
                            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                           "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "string", "maxLength": 8}},
                                           "owner": PERSON}},
         "A record as JSON: an id, ok, optional tags and an owner:\n"),
    Case("ratio", "json", {"type": "number", "minimum": -10, "maximum": 10}, "A number between -10 and 10:\n"),
    Case("email", "regex", r"[a-z]{1,8}@[a-z]{2,8}\.(com|org|net)", "An email address: "),
    Case("date", "regex", r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "A date (YYYY-MM-DD): "),
    Case("answer", "regex", r"(yes|no|maybe)", "Is the sky blue? Answer yes, no or maybe: "),
    Case("hex", "regex", r"0x[0-9a-f]{2,8}", "A hexadecimal constant: "),
    Case("call", "regex", r"[a-z_][a-z0-9_]{0,11}\((\d{1,3}(, \d{1,3}){0,2})?\)", "A Python call: "),
)


def why_invalid(case: Case, text: str) -> str | None:
    """None when `text` satisfies the case, else why not (checked without the engine's grammar)."""
    if case.kind == "regex":
        return None if re.fullmatch(case.schema, text) else "no regex full match"
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    try:
        jsonschema.validate(value, case.schema)
    except jsonschema.ValidationError as e:
        return f"schema: {e.message}"
    return None


def evaluate(llm, cases=CASES, max_tokens: int = 256, samples: int = 1, temperature: float = 0.0,
             seed: int = 0) -> dict:
    """Generate every case `samples` times under its grammar and check every completion (see the module doc)."""
    from deepinfer import SamplingParams

    bos = llm.model.config.bos_token_id
    prompts, params, which = [], [], []
    for case in cases:
        so = {"schema_type": case.kind, "schema": case.schema}
        for k in range(samples):
            prompts.append(llm.detokenizer.encode(case.prompt, bos))
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, so_args=so,
                                         seq_seed=None if temperature == 0 else seed + k))
            which.append(case)
    outs = llm.generate(prompts, params, use_tqdm=False)
    failures, per_case = [], {c.name: [0, 0] for c in cases}
    for case, out in zip(which, outs):
        c = out.outputs[0]
        why = "cut at --max-tokens" if c.finish_reason != "stop" else why_invalid(case, c.text)
        per_case[case.name][1] += 1
        if why is None:
            per_case[case.name][0] += 1
        else:
            failures.append({"case": case.name, "finish_reason": c.finish_reason, "text": c.text, "why": why})
    kinds = sorted({c.kind for c in cases})
    kind_counts = {k: [sum(per_case[c.name][i] for c in cases if c.kind == k) for i in (0, 1)] for k in kinds}
    valid = sum(v for v, _ in per_case.values())
    return {"cases": len(cases), "samples": samples, "temperature": temperature, "max_tokens": max_tokens,
            "completions": len(outs), "valid": valid, "validity_rate": valid / len(outs),
            "truncated": sum(f["finish_reason"] != "stop" for f in failures),
            "validity_per_kind": {k: v / n for k, (v, n) in kind_counts.items()},
            "validity_per_case": {name: v / n for name, (v, n) in per_case.items()}, "failures": failures}


def run(argv: list[str] | None = None) -> dict:
    """The JSON object the command prints, from its arguments."""
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--max-tokens", type=at_least(1), default=256, help="tokens per completion, at most")
    ap.add_argument("--samples", type=at_least(1), default=None,
                    help="completions per case (default: 1 greedy, else 4)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="seq_seed of a case's first sample (then +1 each)")
    ap.add_argument("--cases", default="json,regex", help="kinds of cases to run: json, regex or both")
    args = ap.parse_args(argv)
    kinds = set(args.cases.split(","))
    if not kinds or kinds - {"json", "regex"}:
        ap.error(f"argument --cases: a comma-separated subset of json,regex, got {args.cases!r}")
    if not 0 <= args.temperature < float("inf"):
        ap.error(f"argument --temperature: need a finite number >= 0, got {args.temperature}")
    samples = args.samples or (1 if args.temperature == 0 else 4)
    llm = engine(args)
    try:
        if llm.detokenizer is None:
            raise ValueError("--model: the checkpoint has no tokenizer to encode the prompts with")
        return {"model": str(llm.model_dir), **evaluate(llm, [c for c in CASES if c.kind in kinds],
                                                         args.max_tokens, samples, args.temperature, args.seed)}
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main())
