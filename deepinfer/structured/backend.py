"""Structured outputs on xgrammar: `so_args` parsing, a grammar compile cache fed by worker
threads, and per-request matchers that fill the next token's bitmask on the host.

Bitmask layout (shared with deepinfer.kernels.token_bitmask): int32 words, `bitmask_width =
ceil(vocab_size / 32)` per row, token v allowed iff bit (v % 32) of word v // 32 is 1; vocab_size is
the model's logits width, which may exceed the tokenizer's vocab: ids the tokenizer lacks, and its
special tokens other than the stop tokens, are never allowed while a grammar applies.

xgrammar (and transformers, for the tokenizer) are imported on first use, so `import deepinfer`
works without them; a GrammarBackend cannot be built without them (ImportError naming so_args).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.structured.char_classes import CONTROL, LINE_BREAKS, SURROGATES, exclude
from deepinfer.structured.tool_calls import MARKER as DSML_MARKER

SCHEMA_TYPES = ("json", "regex", "ebnf", "json_object", "structural_tag")
_KEYS = ("schema_type", "schema", "any_whitespace")
# Compact JSON: no whitespace around separators, so a bounded schema bounds the completion's length.
_COMPACT = (",", ":")
# json_object: a JSON object, as OpenAI's response_format json_object promises. Its grammar starts at "{" (no
# leading whitespace) and is complete only at the object's closing "}".
_OBJECT = '{"type":"object"}'
THINK_START, THINK_END = "<think>", "</think>"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("so_args (structured outputs) needs the xgrammar package: install "
                          "requirements/structured.txt, then `pip install --no-deps xgrammar==0.2.9` "
                          f"(as build.sh does); import failed: {e}") from e
    return xgrammar


@dataclass(frozen=True)
class GrammarKey:
    """What the compile cache is keyed by."""
    schema_type: str       # "json" | "regex" | "ebnf" | "json_object" | "structural_tag"
    schema: str            # canonical text: a JSON schema (or an xgrammar structural tag) as compact json.dumps in
                           # its own key order (the order is kept: properties are generated in it); "" for json_object
    any_whitespace: bool = False  # json / json_object only: False = compact JSON, no free whitespace


def opens_thinking(prompt: list[int], think_start_id: int | None, think_end_id: int | None) -> bool:
    """Whether the prompt opens a thinking block: its last <think> comes after its last </think>. False
    when the tokenizer lacks either token. A request's grammar applies only after the output's first
    </think> when this is true, from its first token otherwise."""
    if think_start_id is None or think_end_id is None:
        return False
    for t in reversed(prompt):  # the last of the two decides
        if t == think_start_id:
            return True
        if t == think_end_id:
            return False
    return False


def parse_so_args(so_args: dict) -> GrammarKey:
    """DeepInfer's API: {"schema_type": "regex"|"json"|"ebnf"|"json_object"|"structural_tag", "schema": ...} (a
    JSON schema, or an xgrammar structural tag, as a dict or a JSON string; none for json_object, any JSON
    object), optional "any_whitespace":
    bool (json and json_object only). Structural checks only (no tokenizer, no xgrammar): ValueError naming the
    field."""
    if not isinstance(so_args, dict):
        raise ValueError(f"so_args must be a dict, got {type(so_args).__name__}")
    unknown = sorted(str(k) for k in so_args if k not in _KEYS)
    if unknown:
        raise ValueError(f"so_args: unknown keys {unknown} (allowed: {list(_KEYS)})")
    kind = so_args.get("schema_type")
    if kind not in SCHEMA_TYPES:
        raise ValueError(f"so_args.schema_type must be one of {list(SCHEMA_TYPES)}, got {kind!r}")
    ws = so_args.get("any_whitespace", False)
    if not isinstance(ws, bool):
        raise ValueError(f"so_args.any_whitespace must be a bool, got {ws!r}")
    if ws and kind not in ("json", "json_object"):
        raise ValueError(f"so_args.any_whitespace applies to schema_type json and json_object, not {kind!r}")
    schema = so_args.get("schema")
    if kind == "json_object":
        if schema is not None:
            raise ValueError("so_args.schema must be absent for schema_type 'json_object' (any JSON object)")
        return GrammarKey(kind, "", ws)
    if kind in ("json", "structural_tag"):
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"so_args.schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"so_args.schema must be a dict or a JSON object string for schema_type {kind!r}, "
                             f"got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"so_args.schema is not JSON-serialisable: {e}") from None
        return GrammarKey(kind, text, ws)
    if not isinstance(schema, str) or not schema:
        raise ValueError(f"so_args.schema must be a non-empty string for schema_type {kind!r}, "
                         f"got {schema!r}")
    return GrammarKey(kind, schema, False)


def _build_grammar(key: GrammarKey):
    """The xgrammar Grammar for a key (parse only, no vocab): ValueError naming so_args.schema."""
    xgr = _xgrammar()
    try:
        schema = key.schema if key.schema_type == "json" else _OBJECT
        if key.schema_type == "structural_tag":  # its token terminals do not survive a print and re-parse
            return xgr.Grammar.from_structural_tag(key.schema)
        if key.schema_type == "regex":
            grammar = xgr.Grammar.from_regex(key.schema)
        elif key.schema_type == "ebnf":
            grammar = xgr.Grammar.from_ebnf(key.schema)
        elif key.any_whitespace:
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True)
        else:
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=_COMPACT)
    except Exception as e:  # xgrammar raises RuntimeError (and others) with the parser's message
        msg = str(e).strip().splitlines()
        detail = " ".join(line.split(": ", 1)[-1] if line.startswith("[") else line for line in msg[:3])
        raise ValueError(f"so_args.schema: invalid {key.schema_type} for schema_type "
                         f"{key.schema_type!r}: {detail}") from None
    # leave out surrogates everywhere, control characters from JSON strings, line breaks from `.`
    text = str(grammar)
    json_like = key.schema_type in ("json", "json_object")
    fixed = exclude(text, [SURROGATES], [CONTROL] if json_like else [],
                    list(LINE_BREAKS) if key.schema_type == "regex" else [])
    if fixed == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(fixed)
    except Exception:  # a construct the printed form does not parse back: xgrammar's own classes
        return grammar


@dataclass
class _Compiled:
    """A cache entry's result: the compiled grammar, or the error every request on it reports."""
    grammar: Any = None
    error: str | None = None


class GrammarBackend:
    """One per engine (one tokenizer, one model vocab). validate() runs at submission; request_grammar()
    starts the compile off the caller's thread. Compiles are cached by GrammarKey (LRU of
    `max_cached` entries); a compile in flight is shared by every request that asks for its key."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_token_ids: list[int],
                 max_threads: int = 2, max_cached: int = 256, fill_threads: int | None = None):
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerFast
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        eos = [int(t) for t in eos_token_ids]
        if not eos or any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be non-empty ids below vocab_size {vocab_size}, got {eos}")
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
        vocab = tok.get_vocab()
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.bitmask_width = (vocab_size + 31) // 32
        self.stop_mask = np.zeros(self.bitmask_width, dtype=np.uint32)  # only the stop tokens allowed
        for t in eos:
            self.stop_mask[t // 32] |= np.uint32(1 << (t % 32))
        self.stop_mask = self.stop_mask.view(np.int32)
        self.think_start_id: int | None = vocab.get(THINK_START)
        self.think_end_id: int | None = vocab.get(THINK_END)
        # xgrammar detects the vocab type from the tokenizer; the vocabulary is then rebuilt with
        # every special added token (BOS, <think>, padding tokens ...) as "", which xgrammar never
        # lets a grammar emit: their text is not what the detokenizer writes for them. DSML's marker keeps
        # its text: tool-call tags (structured/tool_calls.py) match it as its token, which xgrammar accepts
        # only for a token with text. Ids past the
        # tokenizer's vocab are "" too; ids past the model's vocab are dropped.
        meta = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=eos).dump_metadata()
        encoded = [""] * vocab_size
        for text, i in vocab.items():
            if i < vocab_size:
                encoded[i] = text
        for i, added in tok.backend_tokenizer.get_added_tokens_decoder().items():
            if added.special and i < vocab_size and added.content != DSML_MARKER:
                encoded[i] = ""
        self.tokenizer_info = xgr.TokenizerInfo.from_vocab_and_metadata(encoded, meta)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)
        # the token ids' bytes ("" for the ids no grammar may emit), for checking output prefixes as text
        self._token_bytes: list[bytes] = self.tokenizer_info.decoded_vocab
        # compiles against a one-entry vocab: milliseconds, for checking a prefix's text at submission
        self._text_compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([""]), max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._max_cached = max_cached
        self._compiled: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._grammars: OrderedDict[GrammarKey, Any] = OrderedDict()  # parsed, not compiled
        self.compiles = 0  # compiles started (cache misses)
        # fill_bitmasks' threads (None: xgrammar's choice, half the hardware threads)
        self._batch = xgr.BatchGrammarMatcher("auto" if fill_threads is None else fill_threads)

    def validate(self, so_args: dict) -> GrammarKey:
        """parse_so_args + build the xgrammar Grammar (fast; no compile against the vocab): an invalid
        JSON schema / regex / EBNF raises ValueError naming so_args.schema and xgrammar's message."""
        key = parse_so_args(so_args)
        self._grammar(key)
        return key

    def _grammar(self, key: GrammarKey):
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = _build_grammar(key)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self._max_cached:
                self._grammars.popitem(last=False)
        return grammar

    def check_prefix(self, key: GrammarKey, prompt: list[int], prefix_len: int) -> None:
        """ValueError (naming so_prefix_tokens, the first token refused and the text so far) unless the
        grammar of `key` accepts the prompt's last `prefix_len` tokens as the start of the output of the
        prompt before them (RequestGrammar.begin_with; free if they are reasoning). Checks
        the tokens' bytes against the grammar compiled without the vocab (fast, for submission); a token
        no grammar may emit (special or outside the tokenizer) is refused."""
        if not 0 <= prefix_len <= len(prompt):
            raise ValueError(f"so_prefix_tokens {prefix_len} is not in [0, {len(prompt)}] (the prompt's length)")
        cut = len(prompt) - prefix_len
        _, tokens = _walk_reasoning(self._opens_thinking(prompt[:cut]), prompt[cut:], self.think_end_id)
        if not tokens:
            return
        matcher = _xgrammar().GrammarMatcher(self._text_compiler.compile_grammar(self._grammar(key)))
        done = b""
        for j, t in enumerate(tokens):
            text = self._token_bytes[t] if 0 <= t < len(self._token_bytes) else b""
            if not text or not matcher.accept_string(text):
                compact = key.schema_type in ("json", "json_object") and not key.any_whitespace
                raise ValueError(f"so_prefix_tokens: the output prefix is not a valid start of the "
                                 f"{key.schema_type} grammar{' (compact JSON: no whitespace)' if compact else ''}: "
                                 f"{text.decode(errors='replace')!r} refused after "
                                 f"{done.decode(errors='replace')!r} (token {j} of {len(tokens)})")
            done += text

    def request_grammar(self, key: GrammarKey, prompt_token_ids: list[int]) -> RequestGrammar:
        """Starts (or reuses) the compile of `key` on a worker thread and returns at once. Reasoning:
        if the prompt's last <think> comes after its last </think> (the prompt opens a thinking block),
        the grammar applies only after the output's first </think> (the tokens before it and the
        </think> itself are free)."""
        with self._lock:
            fut = self._compiled.get(key)
            if fut is None:
                self.compiles += 1
                fut = self._pool.submit(self._compile, key)
                self._compiled[key] = fut
                while len(self._compiled) > self._max_cached:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        return RequestGrammar(self, fut, self._opens_thinking(prompt_token_ids))

    def _opens_thinking(self, prompt: list[int]) -> bool:
        return opens_thinking(prompt, self.think_start_id, self.think_end_id)

    def _compile(self, key: GrammarKey) -> _Compiled:
        xgr = _xgrammar()
        try:
            compiled = self._compiler.compile_grammar(self._grammar(key))
        except ValueError as e:
            return _Compiled(error=str(e))
        except Exception as e:
            return _Compiled(error=f"so_args.schema: compiling the {key.schema_type} grammar failed: {e}")
        mask = np.zeros(self.bitmask_width, dtype=np.int32)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        if not mask.any():
            return _Compiled(error=f"so_args.schema: no token of this tokenizer can start the "
                                   f"{key.schema_type} grammar (it admits no output)")
        return _Compiled(grammar=compiled)

    def fill_bitmasks(self, grammars: list[RequestGrammar], out, rows: list[int] | None = None) -> None:
        """out[rows[i]] = grammars[i].fill_bitmask (rows None: row i), the grammar-phase rows filled in
        parallel by xgrammar's threads. out: int32 [>= len(grammars), bitmask_width], numpy or a
        contiguous CPU torch tensor. Each grammar once per call (distinct matchers); one caller at a
        time (the batch matcher is shared)."""
        rows = list(range(len(grammars))) if rows is None else list(rows)
        if len(rows) != len(grammars):
            raise ValueError(f"fill_bitmasks: {len(grammars)} grammars for {len(rows)} rows")
        matchers, at = [], []
        for g, r in zip(grammars, rows):
            m = None if g._reasoning else g._m()
            if m is None or m.is_terminated():
                g._fill_row(out[r])
            else:
                matchers.append(m)
                at.append(r)
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, out, at)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state: the matcher and the reasoning phase.

    Not thread-safe: one thread at a time per RequestGrammar (distinct ones may run on distinct
    threads). Until ready(), the methods other than ready() / error / fork() wait for the compile;
    after a failed compile they raise ValueError(error).

    Finishing: xgrammar's matcher allows only the stop tokens (EOS) once the grammar is complete and
    nothing more can follow, and is "terminated" once it accepted a stop token. `terminated` here is
    true in both cases, so the engine finishes the request ("stop") right after the token that
    completes the grammar, without a forward pass whose only possible sample is EOS; where the grammar
    is complete but could go on (e.g. regex `a+`), EOS stays allowed and accepting it terminates.
    A request's output thus ends without EOS when the grammar forced the end, or with EOS (accepted)
    when the model chose to stop. In the reasoning phase every token (EOS included) is free and
    `terminated` is false: an EOS sampled there ends the request as EOS does without a grammar.
    """

    def __init__(self, backend: GrammarBackend, future: Future, reasoning: bool):
        self._backend = backend
        self._future = future
        self._matcher = None
        self._prefix: list[int] = []  # begin_with's grammar tokens: the matcher accepts them when it is built
        self._prefix_error: str | None = None
        self._begun = False           # begin_with was called
        self._reasoning = reasoning   # in the reasoning phase now (no constraint)
        self._opened = reasoning      # the output starts in the reasoning phase (the prompt opened it)
        self._n_free = 0              # accepted reasoning-phase tokens, the </think> included
        self._n_matched = 0           # accepted by the matcher (after the free ones)
        self._scratch = np.zeros(backend.bitmask_width, dtype=np.int32)
        self._stop_mask = backend.stop_mask

    @property
    def backend(self) -> GrammarBackend:
        """The backend that compiled it (its fill_bitmasks fills many requests' masks in one call)."""
        return self._backend

    def ready(self) -> bool:
        """The compile is done (ok or failed); never blocks."""
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Once ready(): the reason the request cannot run ("so_args.schema: ..."), else None."""
        if not self._future.done():
            return None
        err = self._result().error
        if err is None and self._prefix and self._matcher is None:
            try:
                self._m()
            except ValueError as e:
                return str(e)
        return err or self._prefix_error

    def _result(self) -> _Compiled:
        """The compile's outcome (waits for it); a cancelled or crashed compile is an error too."""
        try:
            return self._future.result()
        except BaseException as e:  # CancelledError (backend closed) or an unexpected failure
            return _Compiled(error=f"so_args.schema: the grammar compile did not finish: {type(e).__name__}: {e}")

    def _m(self):
        if self._matcher is None:
            done = self._result()
            if done.error is not None:
                raise ValueError(done.error)
            if self._prefix_error is not None:
                raise ValueError(self._prefix_error)
            matcher = _xgrammar().GrammarMatcher(done.grammar)
            for j, t in enumerate(self._prefix):  # not counted in _n_matched: never rolled back
                if not matcher.accept_token(int(t)):
                    self._prefix_error = (f"so_prefix_tokens: the grammar refuses the output prefix's token {j} "
                                          f"(id {t}) of {len(self._prefix)}")
                    raise ValueError(self._prefix_error)
            self._matcher = matcher
        return self._matcher

    def fork(self) -> RequestGrammar:
        """The same state, independent afterwards (n > 1 siblings)."""
        other = RequestGrammar.__new__(RequestGrammar)
        other.__dict__.update(self.__dict__)
        other._matcher = None if self._matcher is None else self._matcher.fork()
        other._scratch = self._scratch.copy()
        return other

    def begin_with(self, tokens: list[int]) -> None:
        """The output begins with `tokens`, given rather than sampled (an assistant message continued, whose
        tokens end the prompt): the reasoning phase and the grammar start as after them, and they are never
        rolled back. Before any token is accepted. If the grammar refuses them, `error` says so once ready()
        (GrammarBackend.check_prefix refuses them at submission)."""
        if self._begun or self._n_free or self._n_matched or self._matcher is not None:
            raise ValueError("begin_with: only once, before the first accepted token")
        self._begun = True
        self._reasoning, self._prefix = _walk_reasoning(self._reasoning, [int(t) for t in tokens],
                                                        self._backend.think_end_id)
        self._opened = self._reasoning

    @property
    def in_reasoning(self) -> bool:
        """Tokens are free now (the output has not closed the thinking block the prompt opened)."""
        return self._reasoning

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted a stop token, or nothing but a stop token can follow:
        the request finishes ("stop")."""
        if self._reasoning:
            return False
        m = self._m()
        if m.is_terminated():
            return True
        if not m.is_completed():
            return False
        m.fill_next_token_bitmask(self._scratch)
        return bool(np.array_equal(self._scratch, self._stop_mask))

    def _fill_row(self, row) -> None:
        if self._reasoning:
            row[...] = -1
            return
        m = self._m()
        if m.is_terminated():  # nothing can follow: only the stop tokens (the engine finishes anyway)
            row[...] = _as_like(self._stop_mask, row)
            return
        m.fill_next_token_bitmask(row)

    def fill_bitmask(self, out) -> None:
        """out: int32 [bitmask_width] (numpy or a contiguous CPU torch row): the mask for the NEXT token;
        all ones (no constraint) in the reasoning phase."""
        self._fill_row(out)

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar rejects it."""
        if self._reasoning:
            self._n_free += 1
            if token == self._backend.think_end_id:
                self._reasoning = False
            return True
        if not self._m().accept_token(int(token)):
            return False
        self._n_matched += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (reasoning-phase tokens too)."""
        if not 0 <= n <= self._n_free + self._n_matched:
            raise ValueError(f"rollback({n}): only {self._n_free + self._n_matched} tokens were accepted")
        k = min(n, self._n_matched)
        if k:
            self._m().rollback(k)
            self._n_matched -= k
        if n > k:  # back into the reasoning phase: the </think> is undone
            self._n_free -= n - k
            self._reasoning = self._opened

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` (drafts) the grammar accepts in a row; state unchanged."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    def fill_bitmasks_along(self, tokens: list[int], out) -> None:
        """out [len(tokens) + 1, bitmask_width]: row j = the mask after accepting tokens[:j] (tokens
        must be a valid prefix: ValueError otherwise); state unchanged."""
        if len(out) < len(tokens) + 1:
            raise ValueError(f"out has {len(out)} rows, need {len(tokens) + 1}")
        n = 0
        try:
            self._fill_row(out[0])
            for t in tokens:
                if not self.accept(t):
                    raise ValueError(f"token {t} at position {n} is not accepted by the grammar")
                n += 1
                self._fill_row(out[n])
        finally:
            self.rollback(n)


def _walk_reasoning(reasoning: bool, tokens: list[int], think_end_id: int | None) -> tuple[bool, list[int]]:
    """Output tokens from a state `reasoning` (in the reasoning phase or not): (the phase after them, those of
    them the grammar must accept, i.e. the ones after the reasoning's </think>)."""
    for j, t in enumerate(tokens):
        if not reasoning:
            return False, tokens[j:]
        reasoning = t != think_end_id
    return reasoning, []


def _as_like(mask: np.ndarray, row):
    """`mask` as something assignable to `row` (a numpy array or a torch tensor)."""
    if isinstance(row, np.ndarray):
        return mask
    import torch
    return torch.from_numpy(mask)
